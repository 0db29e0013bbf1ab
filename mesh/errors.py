"""User-facing errors of the mesh layer, in a module without heavy imports, so the CLI can name
them (exit code 2 with the message) before torch is loaded.

imports: stdlib only.
"""


class DataError(ValueError):
    """The corpus is missing or unusable; the message says how to fix it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message says which file and why."""


class DiskFull(OSError):
    """A write that found no space left (ENOSPC, or over quota): the message names the file;
    nothing torn is left behind (metrics rows and checkpoints are written whole or not at all),
    so the run resumes once space is freed."""


def disk_full(error: BaseException, path: object = None) -> DiskFull | None:
    """The DiskFull for `error` when it, or an exception it was raised from or while handling
    (torch.save wraps a failed write in a RuntimeError), is a full disk; None otherwise.
    path: the file being written, when the OSError does not name one."""
    import errno

    codes = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFull):
            return e
        if isinstance(e, OSError) and e.errno in codes:
            where = path if path is not None else e.filename
            prefix = f"{where}: " if where is not None else ""
            return DiskFull(
                f"{prefix}no space left on device; free some space there, then resume the run "
                "(meshtrain simulate --resume DIR, or join again)"
            )
        e = e.__cause__ or e.__context__
    return None


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
