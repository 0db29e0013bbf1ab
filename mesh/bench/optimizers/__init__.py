"""`meshtrain bench optimizers`: which optimizer keeps a deep asynchronous pipeline converging.

Two studies on the simulator, 1 replica, a 16-layer narrow model (so P = 16 has a block per
stage), 2+ seeds, equal tokens:
- async: PipeDream stashing (delay delta_j = P-1-j) at P in {1, 2, 4, 8, 16} for adamw, nadamw,
  muon, rotated_adam and rotated_adam with stage-aware rotation (+SA). P = 1 is delay-free.
- 2bw: PipeDream-2BW at P = 4, M = 4 (delay 1) for adamw, muon and rotated_adam, each with and
  without error feedback, against gpipe at the same M (same updates, same batch, no delay).

Per run: the updates needed to reach a fixed validation loss (evaluated 30 times per run, 16 in
--quick, linearly interpolated between evaluations; null when never reached) and the final
validation loss. The target of each study is one number for all its runs: by default the
delay-free adamw runs' mean validation loss at half the horizon (async P = 1, resp. gpipe
M = 4), so the reference reaches it at ~50% and a slower run has room to show it; `target`
overrides it.
Also measured: ms per update (mean over updates without an evaluation; the CPU is shared, so
read the ratios) and the optimizer state bytes of every stage (rotated_adam's factors and bases).
Writes summary.json, table.md and depth.png (updates to target against P, log2 axis).

Modules: protocol (the runs and their configs), runs (the worker pool, timing, re-analysis),
analysis (updates to target, the targets), report (table.md, depth.png).
"""
