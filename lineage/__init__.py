"""Checkpoint lineage: object stores, verification, the choice of a pre-suspect checkpoint and the resume pointer."""
