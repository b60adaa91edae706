"""Alembic migrations of the rtrl store, shipped inside the package (``Store.migrate()`` runs them)."""
