"""The simulation: what stands in for real users and real checkpoints when the loop runs on one machine.

- `simulation.client`: the scaffolding every simulated client shares: the gateway connection (the
  official ``openai`` client and a tenant API key, as an application has), feedback posts, the
  simulation's API key and the thread pool the users or agents run in;
- `simulation.users`: users who make one call each and give feedback (``rtrl simulate``);
- `simulation.agents`: agents whose episodes are several calls of one RL method (``rtrl simulate
  --scenario``, docs/methods.md);
- `simulation.demo`: the whole loop, N cycles, on the local services (``rtrl demo``);
- `simulation.checkpoints`: random checkpoints in the shape of real ones (``rtrl model random``).

It sits above the local services (`services`: the demo starts them and the supervisor) and below the
CLI (`rtrl`); the production path (trainer, gate, deployer) never imports it.
"""
