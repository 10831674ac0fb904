"""The expected failures of the catalog workflow (embed into shards, index, similar): each
is one line for the user, and the CLI exits with code 2."""

from __future__ import annotations


class CatalogError(Exception):
    """An expected failure: its message says what to do."""
