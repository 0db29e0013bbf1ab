"""`meshtrain bench throughput`: grids A1-A4 with emulated compute, FullSync vs AsyncMesh.

Protocol: byte-level GPT d=128, L=4, T=128, B=8, M=4;
t_f = 10 ms and t_b = 20 ms per microbatch per stage x the cell's slowdown (emulated compute,
mesh/runtime/emulate.py: no model math, real payloads through the real codecs and transport on
shaped loopback links). For each grid, FullSync (gpipe + blocking fp32 gradient all-reduce) and
AsyncMesh (async pipeline, in-flight window sized from the round trip, background 5% fp8
averaging) run interleaved A B A B ... in windows of about `window_s` seconds each; we report
medians over the windows and the min-max of the per-window ratios.

One set of P x m cell processes per grid runs every window of that grid (a fresh cell and
worker per window, one transport for all, a barrier between windows), so process start-up
(seconds here) is paid once per grid and every window starts on a quiet, connected mesh. Each
window reads the steady state: the first 20% of the last stage's update times are left out.

Outputs: DIR/summary.json (per grid: each method's tokens/s, fraction_of_ideal, bytes per
replica per step against their formulas, peak memory, the window and staleness; the ratio and
the ratio the schedule formulas predict), DIR/table.md, and DIR/<id>/w<k>-<method>/metrics/
(raw rows; under results/ they stay out of git).

Modules: protocol (grids, settings, methods), runs (the cell processes and windows), analysis
(predictions, per-method summaries, targets), report (table.md).
"""
