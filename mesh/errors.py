"""User-facing errors of the mesh layer, in a module without heavy imports, so the CLI can name
them (exit code 2 with the message) before torch is loaded.

imports: stdlib only.
"""


class DataError(ValueError):
    """The corpus is missing or unusable; the message says how to fix it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message says which file and why."""
