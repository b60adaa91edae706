"""The deployer: eval gate, vLLM fleet client, verified rolling hot-swap, MLflow registry aliases.

Called by the trainer chain (`deployer.gate.evaluate`, then `deployer.rollout.promote`) and by
`rtrl deploy ...`. Modules: `registry` (MLflow versions, aliases, local checkpoint cache),
`fleet` (HTTP client of one vLLM server's dev-mode endpoints), `probe` (reference logprobs with
transformers), `gate` (challenger vs champion on the staging server), `rollout` (the swap).
"""
