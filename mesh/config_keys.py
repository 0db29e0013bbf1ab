"""The names of config keys: the key a mistyped one most likely means, keys that were removed
(still accepted at the value every run now has) and keys that moved to another section (mapped,
with a one-line notice). Imports: the sections' key maps only.
"""

from __future__ import annotations

import difflib
import sys
from typing import Any

from mesh.config_local import MOVED_KEYS
from mesh.config_sections import ConfigError

# the names other trainers use for our keys' leaves: matched before edit distance, which would
# turn optim.learning_rate into optim.warmup_steps' neighbours rather than optim.lr
SYNONYMS = {
    "learning_rate": "lr",
    "lr_rate": "lr",
    "momentum": "beta1",
    "wd": "weight_decay",
    "clip": "grad_clip",
    "max_grad_norm": "grad_clip",
    "warmup": "warmup_steps",
    "layers": "n_layers",
    "num_layers": "n_layers",
    "num_hidden_layers": "n_layers",
    "hidden_size": "d_model",
    "num_heads": "n_heads",
    "num_attention_heads": "n_heads",
    "context_length": "seq_len",
    "block_size": "seq_len",
    "max_seq_len": "seq_len",
    "batch_size": "microbatch_size",
    "max_steps": "steps",
    "num_steps": "steps",
    "iterations": "steps",
    "pipeline_stages": "stages",
    "pp": "stages",
    "dp": "replicas",
    "data_parallel": "replicas",
}


def suggest_key(key: str, known: list[str]) -> str | None:
    """The known key a mistyped one most likely means: a synonym of its leaf in the same
    section, then the same leaf (or synonym) in another section, then the closest spelling."""
    *parents, leaf = key.split(".")
    section = ".".join(parents)
    for name in (SYNONYMS.get(leaf.lower(), leaf.lower()), leaf.lower()):
        if f"{section}.{name}" in known:
            return f"{section}.{name}"
        elsewhere = [k for k in known if k.rsplit(".", 1)[-1] == name]
        if len(elsewhere) == 1:
            return elsewhere[0]
    hint = difflib.get_close_matches(key, known, n=1)
    return hint[0] if hint else None


# keys that no longer exist: key -> (the value that is what every run now does, why). A config
# that spells out that value (every run's config.toml written while the key existed does) still
# loads; any other value is a ConfigError, since the run would not do what it asks.
REMOVED_KEYS = {
    "runtime.mean_path": (
        "direct",
        "removed (issue 16): hivemind's averager path is gone and averaging rounds always take "
        "the direct all-gather on the peers' streams; delete the key",
    ),
}


def is_removed(key: str, value: Any, origin: str) -> bool:
    """Whether `key` is a removed key (to be left out of the tree); ConfigError if its value
    asks for what was removed."""
    if key not in REMOVED_KEYS:
        return False
    kept, why = REMOVED_KEYS[key]
    if value != kept:
        raise ConfigError(f"{key} = {value!r}: {why} (from {origin})")
    return True


_NOTICED: set[str] = set()  # moved keys already announced by this process


def moved_to(key: str, origin: str) -> tuple[str, ...]:
    """Where a key of the old single [runtime] table lives now (the key itself when it did not
    move), with a one-line notice on stderr the first time this process meets it."""
    new = MOVED_KEYS.get(key)
    if new is None:
        return (key,)
    if key not in _NOTICED:
        _NOTICED.add(key)
        print(
            f"meshtrain: config key {key} is now {' and '.join(new)} (from {origin}); "
            "it still works",
            file=sys.stderr,
        )
    return new


def move_old_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """A tree with [runtime] keys that moved (an older peer's or run's) in their new sections;
    a key the tree also gives in its new place keeps that value."""
    node = tree.get("runtime")
    if not isinstance(node, dict) or not any(f"runtime.{k}" in MOVED_KEYS for k in node):
        return tree
    tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    for leaf in [k for k in node if f"runtime.{k}" in MOVED_KEYS]:
        value = tree["runtime"].pop(leaf)
        for new in moved_to(f"runtime.{leaf}", "an older config"):
            section, key = new.split(".")
            tree.setdefault(section, {}).setdefault(key, value)
    return tree
