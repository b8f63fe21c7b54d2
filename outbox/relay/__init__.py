"""The relay's machinery: the process (:mod:`outbox.relay.relay`) and its parts.

An application does not import these modules: it imports :mod:`outbox` (the public API),
which these build on; the operator's tools (:mod:`outbox.ops`) build on both.
"""
