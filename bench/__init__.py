"""outbox's benchmark suite (issue 4): ``python -m bench`` from the repository root.

Scenarios, one module each: ``raw`` (the own-statement limit: outbox's claim and
completion under pgbench and psycopg), ``ceiling`` (the leanest SQL doing outbox's work,
claim + complete and the whole pipeline, under pgbench), ``e2e`` (end-to-end fan-out
through one relay), ``peers`` (PgQueuer and procrastinate, in their own venv),
``publish_cost``, ``latency``, ``scale``, ``soak``, ``ordered``, ``forward``,
``metrics_cost``; ``profile`` says where the relay's time goes. See docs/performance.md
for the latest results.
"""
