"""The deployer: eval gate, swap-verification probe, verified rolling hot-swap, rollback, bootstrap.

Called by the trainer chain (`deployer.gate.evaluate`, then `deployer.rollout.promote`), by
``rtrl run`` / the demo (`deployer.rollout.bootstrap`) and by ``rtrl deploy ...``. Modules:
`probe` (reference logprobs with transformers), `gate` (challenger vs champion on the staging
server), `rollout` (the swap, rollback, fleet alignment). The vLLM client is `serving`, the MLflow
client `registry`.
"""
