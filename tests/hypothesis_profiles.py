"""How many examples a property test draws under the hypothesis profile in use.

A property test states the count it draws under hypothesis' own default of 100 examples
per test (``@settings(max_examples=examples(2000))``); a profile scales every such count by
its ``max_examples`` over 100, so one number per profile (registered in tests/conftest.py)
sets how thorough the whole suite is: ``dev``, the default, draws a twentieth; ``ci`` a
quarter; ``thorough`` every example a test states."""

from __future__ import annotations

from hypothesis import settings

#: hypothesis' own default number of examples per test, the scale the counts are written in
BASE = 100


def examples(thorough: int) -> int:
    """``thorough`` scaled to the profile loaded (at least 5): read when the test module is
    imported, after tests/conftest.py and ``--hypothesis-profile`` chose the profile."""
    return max(5, round(thorough * settings.default.max_examples / BASE))
