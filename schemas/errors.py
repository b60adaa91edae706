"""The one exception type that crosses packages: an error the operator can fix.

Each package has its own root exception; those of its errors that an operator fixes (a missing
system package, a busy port, a bad setting, an unknown task, a store that was never migrated)
also derive from `OperatorError`, and their message says how. The ``rtrl`` command prints such an
error as one line and exits 1 (a traceback only with ``rtrl --debug``).
"""

from __future__ import annotations


class OperatorError(Exception):
    """An error whose message tells the operator what to do about it."""
