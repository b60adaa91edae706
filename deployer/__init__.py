"""The deployer: eval gate, swap-verification probe, verified rolling hot-swap, rollback, bootstrap.

Called by the worker's chain (`deployer.gate.evaluate`, then `deployer.rollout.promote`), by
``rtrl run`` / the demo (`deployer.rollout.bootstrap`) and by ``rtrl deploy ...``; it never imports
the trainer. Modules: `probe` (reference logprobs with transformers), `swap` (one server's verified
swap, and the interface the gate and the fleet share), `gate` (challenger vs champion on the staging
server), `rollout` (the fleet: canary first, one by one, rollback, fleet alignment). The vLLM
client is `serving`, the MLflow client `registry`.
"""
