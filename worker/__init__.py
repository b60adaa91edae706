"""The worker: the Celery app and beat, and the cycle chain train → eval gate → deploy.

It joins the two stages below it, `trainer/` (the training cycle) and `deployer/` (the gate and the
rolling swap), which never import each other. Started by ``rtrl worker`` (one Celery worker
process, one cycle at a time) and ``rtrl beat``; ``rtrl train now`` enqueues a cycle (or, with
``--inline``, runs the chain in its own process). Modules: `app` (the Celery app and its
configuration), `tasks` (the Celery tasks, their retries and beat's check), `chain` (train →
gate → deploy, without Celery).
"""
