"""Ledger: cost per successful task, wasted and idle spend, from the lifecycle events.

It prices the GPU-seconds and KV transfers each prefill and decode reports (`pricing.py`, pure),
folds each batch into requests, tasks and workers (`fold.py`, `tasks.py`, pure), records them
idempotently by `event_id` in a SQL database (`store.py`: SQLite or PostgreSQL through
SQLAlchemy's async Core), accounts idle GPU time from the workers' heartbeats (`idle.py`),
computes the figures of merit (`figures.py`), keeps each workflow's running spend in the
WORKFLOW_SPEND KV bucket (`workflow_spend.py`) and serves the figures over HTTP and as
Prometheus gauges (`service.py`) and to `ripplemesh ledger report` (`report.py`). See README.md.
"""
