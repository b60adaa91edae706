"""MLflow for every rtrl process: the one `Registry` client (runs, model versions, aliases, checkpoints).

The trainer logs cycles and registers checkpoints through it, the deployer moves aliases and
downloads checkpoints, the CLI reads it. Importing this package does not import MLflow.
"""

from registry.client import CHALLENGER, CHAMPION, DOWNLOAD_COMPLETE, Registry, VersionRecord, flatten
from registry.errors import NoChampion, RegistryError, RegistryRefused, RegistryUnavailable

__all__ = [
    "CHALLENGER",
    "CHAMPION",
    "DOWNLOAD_COMPLETE",
    "NoChampion",
    "Registry",
    "RegistryError",
    "RegistryRefused",
    "RegistryUnavailable",
    "VersionRecord",
    "flatten",
]
