"""CLI command groups. Each module has ``register(app)``; heavy imports stay inside the commands."""
