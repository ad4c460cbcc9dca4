"""Ledger: the cost of every request, from the lifecycle events on ``rmesh.events.>``.

It prices the GPU-seconds each prefill and decode reports (`pricing.py`, pure), records them
idempotently by `event_id` in a SQL database (`store.py`: SQLite or PostgreSQL through SQLAlchemy's
async Core), and serves per-request, per-tenant and fleet totals over HTTP (`service.py`).
"""
