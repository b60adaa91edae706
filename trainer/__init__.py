"""The trainer: the training cycle (CISPO on DeepSpeed), its lease, batch selection and checkpoints.

A stage beside the deployer, which it never imports: the chain train → eval gate → deploy, the
Celery app and beat are in worker/. Run in the ``rtrl worker`` process (one cycle at a time); read
trainer/cycle.py first.
"""
