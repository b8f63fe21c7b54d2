"""outbox's benchmark suite (issue 4): ``python -m bench`` from the repository root.

Scenarios, one module each: ``raw`` (the raw-SQL limit with pgbench and psycopg),
``e2e`` (end-to-end fan-out through one relay), ``peers`` (PgQueuer and procrastinate,
in their own venv), ``publish_cost``, ``latency``, ``scale``, ``soak``; ``profile`` says
where the relay's time goes. See docs/performance.md for the latest results.
"""
