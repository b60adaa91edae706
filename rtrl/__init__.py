"""rtrl: the CLI, the daemon supervisor, the simulated users and the demo."""

__version__ = "0.1.0"
