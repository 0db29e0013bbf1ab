"""What a deep asynchronous pipeline gets without flags: the optimizer settings keyed on the depth
(`optim.depth_rule = "auto"`), from `meshtrain bench depth` (results/depth, docs/depth.md).

Stage j of an async pipeline applies gradients P-1-j updates stale. At P = 4 the shipped
optimizer loses nothing to FullSync at equal tokens; deeper, it does, and the study measures which
of the seeds' levers closes the gap. A rule names, for pipelines of at least `min_stages` stages
on the async schedule, the settings the study picked, and the evidence.

Resolution (Config.effective): a key the rule names takes the rule's value only where the config
leaves it at the schema default, so anything a user sets wins. The rule is applied when a config
is read for training, planning or showing, never written back into the config, so a config
whose depth changes later (a study's overrides) resolves again for its new depth. The fingerprint
hashes the resolved values, so two configs that train the same numbers agree whether they
spelled a setting out or took it from the rule.

Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DepthRule:
    min_stages: int
    settings: dict[str, Any] = field(default_factory=dict)  # optim keys -> values
    evidence: str = ""


# deepest last; a pipeline takes the last rule whose min_stages it reaches (none below them)
RULES: tuple[DepthRule, ...] = ()


def rule_for(stages: int, schedule: str, rules: tuple[DepthRule, ...] = RULES) -> DepthRule | None:
    """The rule an async pipeline of `stages` stages takes (None: none applies; the flushed
    schedules and 2bw have no stale-gradient spread to correct)."""
    if schedule != "async":
        return None
    found = None
    for rule in rules:
        if stages >= rule.min_stages:
            found = rule
    return found


def resolved_settings(
    optim: dict[str, Any],
    defaults: dict[str, Any],
    stages: int,
    schedule: str,
    rules: tuple[DepthRule, ...] = RULES,
) -> dict[str, Any]:
    """The optim keys the rule sets on this config: those it names that `optim` (the section's
    values) leaves at their schema `defaults`."""
    rule = rule_for(stages, schedule, rules)
    if rule is None:
        return {}
    return {k: v for k, v in rule.settings.items() if optim.get(k) == defaults.get(k)}


def describe(
    switch: str,
    settings: dict[str, Any],
    stages: int,
    schedule: str,
    rules: tuple[DepthRule, ...] = RULES,
) -> str:
    """One line on what optim.depth_rule did to a config (show-config and plan print it)."""
    if switch == "off":
        return "optim.depth_rule = off: the optimizer's settings as given, at any depth"
    rule = rule_for(stages, schedule, rules)
    if rule is None or not settings:
        why = "no rule for" if rule is None else "every key it names is set explicitly at"
        return f"optim.depth_rule = auto: {why} P = {stages} ({schedule}); nothing changed"
    said = ", ".join(f"optim.{k} = {v!r}" for k, v in settings.items())
    return f"optim.depth_rule = auto at P = {stages}: {said} ({rule.evidence})"
