"""The usage ledger: one record per admitted inference request, in the key registry's database.

``records`` (``UsageRecord``), ``store`` (the tables and their daily rollup), ``ledger`` (the
batched writer with its local spool), ``budgets`` (per-key token budgets per UTC day and month),
``report`` (``GET /v1/usage`` and ``serve-app usage report``), ``cli`` (``serve-app usage``).
"""
