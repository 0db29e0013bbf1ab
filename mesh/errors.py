"""User-facing errors of the mesh layer, in a module without heavy imports, so the CLI can name
them (exit code 2 with the message) before torch is loaded.

imports: stdlib only.
"""


class DataError(ValueError):
    """The corpus is missing or unusable; the message says how to fix it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message says which file and why."""


class MissingExtra(ValueError):
    """A feature whose package is an optional extra that is not installed: the message names
    the feature, the package and the pip command."""


EXTRAS = {  # module -> (extra, package): pyproject.toml's optional dependencies
    "matplotlib": ("plots", "matplotlib"),
    "pyarrow": ("parquet", "pyarrow"),
    "tensorboard": ("metrics", "tensorboard"),
    "prometheus_client": ("metrics", "prometheus-client"),
    "bitsandbytes": ("cuda8bit", "bitsandbytes"),
}


def need_extra(module: str, feature: str) -> MissingExtra:
    """The error for `feature` when `module` cannot be imported."""
    extra, package = EXTRAS[module]
    return MissingExtra(
        f"{feature} needs {package}, which is not installed: pip install 'meshtrain[{extra}]'"
    )
