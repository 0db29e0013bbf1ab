"""What a deep asynchronous pipeline gets without flags: the optimizer settings keyed on the depth
(`optim.depth_rule = "auto"`), from `meshtrain bench depth` (results/depth, docs/depth.md).

Stage j of an async pipeline applies gradients P-1-j updates stale. At P = 4 the plain optimizer
loses nothing to FullSync at equal tokens; deeper, it does, and the study measures which of the
seeds' levers closes the gap (and at P = 4, which one gains most). A rule names, for
pipelines of at least `min_stages` stages on the async schedule, the settings the study picked,
and the evidence.

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
    optimizer: str = "nadamw"  # the optimizer the study measured it with (optim.name)
    max_stages: int | None = None  # the deepest pipeline it holds for (None: any deeper one)
    # the widest model (model.d_model) its lr was measured on: a wider one keeps its own lr and
    # takes the rest (a model's best lr falls with its width: at d 192, P = 8 the corrected
    # pipeline's is 1e-3, and d 64's 2e-3 ends 2.24)
    lr_width: int = 64


# deepest last; a pipeline takes the last rule whose range holds its depth (none below them).
# 4 <= P <= 7: Muon (its matrices at 10x the default lr, which the rest keeps). At P = 4 on
# seed 100 its best lr is 1e-3 (1.593; 5e-4: 1.644, 2e-3: 1.615), ahead of AsyncPP's lr
# correction (1.717 at its best lr, 4e-3, twice the plain pipeline's), the plain pipeline
# (1.779) and FullSync (AdamW, 1.803); on the report seeds 0 and 1 it ends -11.43% +- 1.12%
# from FullSync (AdamW), the correction -2.50%, and +0.01% +- 0.62% from FullSync with Muon
# (1.598 / 1.596 at 4e-3): at four stages the optimizer held fixed is at parity. P = 5-7 take
# this rule (not measured between 4 and 8). Muon at its default momentum (0.95) at P = 8, which
# the next rule's 0.9 replaced: on seed 100 its best lr is 1e-3 (1.698; 5e-4: 1.733, 2e-3:
# 1.752), ahead of every other lever the screen measured: AsyncPP's lr correction (stage j
# starts at lr / delta_j, the full lr from half the run) 1.798 at 2e-3, rotated Adam 1.759,
# the plain pipeline 1.898, FullSync (AdamW) 1.791. On
# the report seeds 0 and 1 Muon ends -6.65% +- 0.47% from FullSync, the correction -0.04% +- 0.38%,
# the plain pipeline +6.28% (a 16-block d 64 Llama, 1.64M tokens, FullSync at 0.73 of the
# bigram). With Muon in FullSync too the async pipeline is +6.46% +- 0.30% behind (FullSync
# with Muon 1.595 / 1.608 at 4e-3): Muon helps the synchronous pipeline more, as at 16 stages.
# P >= 16: Muon on top of the correction, at the default lr (Muon's matrices at 10x it). Stage 0
# is 15 updates stale there; on seed 100 the correction alone ends 1.929 (its best lr, 1e-3),
# held to the run's end 1.940, never released whole (share 2) 1.897 at 4e-3, with beta1 0.95
# 2.102, with weight prediction 1.957; 2BW with Muon and error feedback at M = 16 ends level
# with FullSync at that M (2.471 both: 100 updates are too few at this budget); with Muon
# 1.785 at 1e-3 (5e-4: 1.828, 2e-3: 1.827) against FullSync's 1.782 (4e-3, inside its grid).
# With the optimizer held fixed it is not parity: FullSync with Muon ends 1.617 (4e-3), which the
# stale stages cannot follow; the rule is the best async pipeline measured at this depth
# 8 <= P <= 15: Muon at momentum 0.9 (0.95 is Muon's own default). Asynchrony acts as momentum
# of its own (Mitliagkas et al. 2016), so a stale pipeline wants less of it: on seed 100 at P = 8
# its best lr is 1e-3 (1.662; 5e-4: 1.718, 2e-3: 1.700) against 0.95's 1.698; on the report seeds
# it ends -9.79% +- 0.06% from FullSync (AdamW) and +2.87% +- 0.16% from FullSync with Muon
# (0.95: +6.46%). At d 192 x 8 (P = 8, seed 100) it is ahead of 0.95 at every lr of its grid
# (2.5e-4 .. 2e-3; best 1e-3, 1.534 against 0.95's best 1.559); results/depth's width table
# holds its report seeds. At P = 4 (parity with 0.95) it is not measured. At P >= 16 on the
# correction too: on seed 100 at 1e-3 it ends 1.734 against 0.95's 1.785 (FullSync 1.782), and
# on the report seeds 1.7432 / 1.7396 against 0.95's 1.7889 / 1.7959. On the correction at
# P = 8 it is ahead at 1.64M tokens (1.6374 / 1.6322 at 1e-3; d 192: 1.5088 / 1.5070 against
# 1.5367 / 1.5264) but behind at 4x the tokens (seed 0: 1.4131 against 1.3963; FullSync with
# Muon 1.3989): the correction keeps stale stages below the full lr for a share of the run,
# which a longer run pays for in updates; so 8-15 stages take Muon at 0.9 alone.
RULES: tuple[DepthRule, ...] = (
    DepthRule(
        4,
        {"name": "muon", "muon_lr": 1e-2},
        "bench depth: Muon -11.43% +- 1.12% at P = 4 from FullSync on seeds 0 and 1 (the lr "
        "correction -2.50%); results/depth, docs/depth.md",
        max_stages=7,
    ),
    DepthRule(
        8,
        {"name": "muon", "muon_lr": 1e-2, "muon_momentum": 0.9},
        "bench depth: Muon at momentum 0.9 -9.79% +- 0.06% at P = 8 from FullSync on seeds 0 "
        "and 1 (at 0.95 -6.65%, the lr correction -0.04%); results/depth, docs/depth.md",
        max_stages=15,
    ),
    DepthRule(
        16,
        {"delay_lr_share": 0.5, "name": "muon", "muon_lr": 1e-2, "muon_momentum": 0.9},
        "bench depth at P = 16: -3.82% +- 0.89% from FullSync on seeds 0 and 1 (at momentum 0.95 "
        "-1.01%, the correction alone +8.3% on seed 100, the plain pipeline +26.7%); "
        "results/depth, docs/depth.md",
    ),
)


def rule_for(
    stages: int, schedule: str, optimizer: str = "nadamw", rules: tuple[DepthRule, ...] = RULES
) -> DepthRule | None:
    """The rule an async pipeline of `stages` stages with `optimizer` takes (None: none
    applies; the flushed schedules and 2bw have no spread of stale gradients to correct, and a
    rule holds for the optimizer it was measured with)."""
    if schedule != "async":
        return None
    found = None
    for rule in rules:
        deep_enough = stages >= rule.min_stages
        not_too_deep = rule.max_stages is None or stages <= rule.max_stages
        if deep_enough and not_too_deep and optimizer == rule.optimizer:
            found = rule
    return found


def resolved_settings(
    optim: dict[str, Any],
    defaults: dict[str, Any],
    stages: int,
    schedule: str,
    rules: tuple[DepthRule, ...] = RULES,
    d_model: int | None = None,
) -> dict[str, Any]:
    """The optim keys the rule sets on this config: those it names that `optim` (the section's
    values) leaves at their schema `defaults`; not the lr on a model wider than the rule's
    lr_width (d_model None: any width)."""
    rule = rule_for(stages, schedule, str(optim.get("name", "nadamw")), rules)
    if rule is None:
        return {}
    wide = d_model is not None and d_model > rule.lr_width
    return {
        k: v
        for k, v in rule.settings.items()
        if optim.get(k) == defaults.get(k) and not (wide and k == "lr")
    }


def describe(
    switch: str,
    settings: dict[str, Any],
    stages: int,
    schedule: str,
    optimizer: str = "nadamw",
    rules: tuple[DepthRule, ...] = RULES,
) -> str:
    """One line on what optim.depth_rule did to a config (show-config and plan print it)."""
    if switch == "off":
        return "optim.depth_rule = off: the optimizer's settings as given, at any depth"
    if schedule != "async":
        # a study row or a user switching to a flushed schedule would otherwise read "no rule
        # for P = 8" and not see that the optimizer it names is what trains
        return (
            f"optim.depth_rule = auto: the rules hold for the async schedule only (this is "
            f"{schedule}), so {optimizer} trains as given; name optim.name=muon (and its keys) "
            "to take a rule's optimizer here"
        )
    rule = rule_for(stages, schedule, optimizer, rules)
    if rule is None or not settings:
        why = "no rule for" if rule is None else "every key it names is set explicitly at"
        return (
            f"optim.depth_rule = auto: {why} P = {stages} ({schedule}, {optimizer}); "
            "nothing changed"
        )
    said = ", ".join(f"optim.{k} = {v!r}" for k, v in settings.items())
    return f"optim.depth_rule = auto at P = {stages}: {said} ({rule.evidence})"
