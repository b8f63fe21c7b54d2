"""The retry-delay policy: capped exponential backoff with jitter, as a pure function.

``delay = min(cap, base * 2 ** (attempt - 1))``, then a random share ``jitter`` of it is
taken off, so retries of many jobs that failed together spread out instead of arriving
as one wave ("Exponential Backoff And Jitter", AWS Architecture Blog; seed article 003,
"cap the exponent"). The exponent is capped before it is raised, so no attempt count,
however large, overflows a float or a PostgreSQL interval.
"""

from __future__ import annotations

import math
import random


def retry_delay(
    attempt: int,
    *,
    base: float = 1.0,
    cap: float = 3600.0,
    jitter: float = 0.25,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retrying after failed attempt number ``attempt`` (1-based).

    The result lies in ``[(1 - jitter) * d, d]`` where ``d = min(cap, base * 2**(attempt-1))``.
    ``base`` and ``cap`` are seconds (``0 < base <= cap``), ``jitter`` a share in ``[0, 1]``;
    ``rng`` defaults to the module's shared generator. Raises ValueError on out-of-range
    arguments.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an int >= 1, got {attempt!r}")
    if not (0 < base <= cap) or not math.isfinite(cap):
        raise ValueError(f"need 0 < base <= cap < inf, got base={base}, cap={cap}")
    if not 0 <= jitter <= 1:
        raise ValueError(f"jitter must be within [0, 1], got {jitter}")
    # 2**e * base reaches cap once e >= log2(cap) - log2(base) (at most 2098 for finite
    # floats: log2(cap / base) itself may overflow); stop raising there. A product past
    # the largest float is past cap too.
    exponent = min(attempt - 1, math.ceil(math.log2(cap) - math.log2(base)) + 1)
    try:
        delay = min(cap, math.ldexp(base, exponent))
    except OverflowError:
        delay = cap
    draw = (rng or random).random()
    return delay * (1.0 - jitter * draw)
