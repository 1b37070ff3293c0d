"""The error every command adapter raises for a failure the user must see."""

from __future__ import annotations


class CommandError(Exception):
    """A user-facing failure: printed as ``sdcguard: error: ...`` with exit status 1."""
