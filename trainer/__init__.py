"""The trainer: Celery app and beat, the training cycle (CISPO on DeepSpeed), checkpoints, and the
cycle chain train → eval gate → deploy (which is why it sits above the deployer).

Started by ``rtrl worker`` (one Celery worker process, one cycle at a time) and ``rtrl beat``;
``rtrl train now`` enqueues a cycle. Read trainer/cycle.py first.
"""
