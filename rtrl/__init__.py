"""rtrl: the CLI (`rtrl.cli`, one module per command group in `rtrl.commands`) and what it prints
(`rtrl.status`, `rtrl.report`). The supervisor and the local services are in `services`, the demo
and the simulated users and agents in `simulation`."""

__version__ = "0.1.0"
