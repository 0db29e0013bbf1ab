"""`meshtrain plan`'s figures against the real tensors of built cells (tiny presets)."""

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from comms import codecs
from mesh.config import load_config
from mesh.engine.plan import plan, plan_cell
from mesh.engine.sim import GridSim
from mesh.model.build import build_stage, lm_loss, stage_forward, stage_layers

TINY_LLAMA = [
    "model.arch='llama'",
    "model.n_layers=4",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.intermediate_size=48",
    "model.seq_len=32",
]
PRESETS = {
    "tiny": (["configs/models/tiny.toml"], []),
    "tiny-llama": ([], TINY_LLAMA),
}


def saved_and_output_bytes(module, x, precision, targets=None):
    """What autograd really keeps from one forward (+ the loss), and the output's bytes."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {n: p.detach().requires_grad_() for n, p in module.named_parameters()}
    own = {p.untyped_storage().data_ptr() for p in params.values()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage_forward(module, params, x, precision)
        if targets is not None:
            lm_loss(out, targets)
    return sum(n for ptr, n in seen.items() if ptr not in own) + out.numel() * out.element_size()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_figures_match_what_autograd_keeps(preset, precision):
    files, sets = PRESETS[preset]
    cfg = load_config(
        files, [*sets, f"runtime.precision='{precision}'", "pipeline.microbatch_size=2"]
    )
    B, T, V = 2, cfg.model.seq_len, cfg.model.vocab_size
    for j in range(cfg.grid.stages):
        _, first, last = stage_layers(cfg.model, cfg.grid.stages, j)
        module = build_stage(cfg.model, cfg.grid.stages, j, 0)
        # a later stage's input needs its gradient (it goes back over the link)
        x = (
            torch.randint(0, V, (B, T))
            if first
            else torch.randn(B, T, cfg.model.d_model, requires_grad=True)
        )
        y = torch.randint(0, V, (B, T)) if last else None
        real = saved_and_output_bytes(module, x, precision, y)
        assert plan_cell(cfg, j).activation_bytes == pytest.approx(real, rel=0.01), j


@pytest.mark.parametrize("preset", PRESETS)
def test_state_figures_match_a_trained_cell(preset, text_file):
    files, sets = PRESETS[preset]
    cfg = load_config(
        files,
        [
            *sets,
            "optim.error_feedback=true",
            "run.steps=8",
            f"data.path='{text_file}'",
            "pipeline.microbatch_size=2",
            "data.val_batches=1",
            # the velocity of every delayed stage counts with the optimizer's state
            "pipeline.weight_prediction=1",
        ],
    )
    sim = GridSim(cfg)
    for _ in range(8):  # past every stage's stash depth and tau
        sim.step()
    for j, planned in enumerate(plan(cfg)):
        cell = sim.cells[0][j]
        flat = cell.flat.numel() * 4
        assert planned.params == cell.num_params
        assert planned.weights_bytes == flat == planned.drift_bytes
        assert planned.stash_bytes == sum(v.numel() * 4 for v in cell.history.values())
        assert planned.versions == len(cell.history) == cell.versions_to_keep()
        assert (
            planned.optimizer_bytes + planned.error_feedback_bytes == cell.optimizer.state_bytes()
        )
        assert planned.error_feedback_bytes == flat
        held = sum(
            r.indices.numel() * 8 + r.snapshot.numel() * 4 + (r.mean.numel() * 4)
            for r, _ in cell.rounds.entries
        )
        rounds_planned = (cfg.dp.tau + 1) * max(len(r.indices) for r, _ in cell.rounds.entries) * 16
        assert held <= rounds_planned <= planned.averaging_bytes
        tokens = cfg.tokens_per_microbatch
        act = torch.randn(tokens, cfg.model.d_model)
        one_way = codecs.encode(act, cfg.pipeline.codec).nbytes / tokens
        links = (j < cfg.grid.stages - 1) + (j > 0)
        assert planned.pp_up_bytes_per_token == pytest.approx(one_way * links)


def test_8bit_states_shrink_the_moments():
    adam = ["optim.depth_rule=off"]  # NAdamW's two moments (at P = 4 the rule gives Muon)
    cfg = load_config(["configs/models/llama-20m.toml"], adam)
    full = plan_cell(cfg, 1).optimizer_bytes
    q8 = plan_cell(
        load_config(["configs/models/llama-20m.toml"], [*adam, "optim.state_8bit=true"]), 1
    )
    assert full == 2 * 4 * q8.params  # m and v in fp32
    assert q8.optimizer_bytes < 0.27 * full  # 1 byte a value + a scale per 256 (norms stay fp32)


def test_plan_command_shows_llama_1b(tmp_path):
    res = CliRunner().invoke(
        main, ["plan", "--config", "configs/models/llama-1b.toml", "--memory-gb", "24"]
    )
    assert res.exit_code == 0, res.output
    assert "1,166,747,904 parameters on 4 stages" in res.output
    assert "fits 24 GB" in res.output and "int8_blockwise" in res.output
    res = CliRunner().invoke(main, ["plan", "--tokens-per-s", "0"])
    assert res.exit_code == 2


def test_show_config_prints_parameters_per_stage():
    res = CliRunner().invoke(main, ["show-config", "--config", "configs/models/llama-1b.toml"])
    assert res.exit_code == 0, res.output
    assert "# parameters per stage: s0 328,550,400, s1 254,822,400" in res.output
    assert "(total 1,166,747,904)" in res.output


# ---- the memory answer: precision, fits, the stage to take ---------------------------------


def _table_column(output: str, header: str) -> list[str]:
    lines = [line for line in output.splitlines() if line.startswith("|")]
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    col = names.index(header)
    return [[c.strip() for c in line.strip("|").split("|")][col] for line in lines[2:6]]


def test_plan_recommends_the_largest_stage_that_fits():
    from cli.plan import _gb_short

    # the default grid's stages differ: stage 0 keeps 4 versions and the embedding, stage 2 two
    cfg = load_config([], [])
    totals = sorted((c.total_bytes, c.stage) for c in plan(cfg))
    assert len({t for t, _ in totals}) == 4, totals  # four different sizes
    # room for the two smallest stages, not the third
    memory_gb = (totals[1][0] + totals[2][0]) / 2 / 1e9
    res = CliRunner().invoke(main, ["plan", "--memory-gb", repr(memory_gb)])
    assert res.exit_code == 0, res.output
    fits = _table_column(res.output, f"fits {_gb_short(memory_gb * 1e9)} GB")
    fitting = sorted(s for _, s in totals[:2])
    assert [j for j, f in enumerate(fits) if f == "yes"] == fitting
    assert f"stages {fitting[0]}, {fitting[1]} fit; take stage {totals[1][1]} " in res.output
    assert f"meshtrain join --stage {totals[1][1]}" in res.output
    assert "precision: fp32 compute (runtime.precision)" in res.output
    assert f"memory: --memory-gb {memory_gb:g}" in res.output


def test_plan_with_no_stage_that_fits_names_the_leaner_settings():
    res = CliRunner().invoke(
        main, ["plan", "--config", "configs/models/llama-1b.toml", "--memory-gb", "13"]
    )
    assert res.exit_code == 0, res.output
    assert set(_table_column(res.output, "fits 13 GB")) == {"no"}
    assert "with 13 GB: no stage fits; the smallest, stage 2, needs 14.80 GB" in res.output
    # bf16 compute and 8-bit states bring stage 2 to 12.49 GB
    assert (
        "with --set runtime.precision=bf16 --set optim.state_8bit=true: stage 2 fits; "
        "take stage 2 (12.49 GB)" in res.output
    )
    res = CliRunner().invoke(main, ["plan", "--memory-gb", "0"])
    assert res.exit_code == 2 and "--memory-gb must be > 0" in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_plan_without_a_gpu_says_so_and_checks_this_machines_memory():
    from cli.plan import _gb_short, host_memory_bytes

    res = CliRunner().invoke(main, ["plan", "--json"])
    assert res.exit_code == 0, res.output
    import json

    out = json.loads(res.output)
    assert out["memory_bytes"] == host_memory_bytes()
    assert out["memory_source"].startswith("no GPU here (torch sees none)")
    assert out["take_stage"] == 0 and out["precision"] == "fp32"
    res = CliRunner().invoke(main, ["plan"])
    host = _gb_short(host_memory_bytes())
    assert f"no GPU here (torch sees none): assumed this machine's memory, {host} GB" in res.output
    assert f"fits {host} GB" in res.output
    assert "the whole grid, as `meshtrain simulate` runs it here: 0.07 GB, fits" in res.output


def test_memory_to_check_prefers_the_flag_then_the_smallest_gpu():
    from cli.plan import memory_to_check

    gpus = [("big", 80_000_000_000), ("small", 24_000_000_000)]
    assert memory_to_check(16.0, gpus, 10**12) == (16e9, "--memory-gb 16")
    memory, source = memory_to_check(None, gpus, 10**12)
    assert memory == 24e9 and source == "this machine's GPU: small, 24 GB, the smallest of 2"
    memory, source = memory_to_check(None, [], 32_000_000_000)
    assert memory == 32e9 and source.startswith("no GPU here")
    memory, source = memory_to_check(None, [], 32_000_000_000, "cpu")
    assert memory == 32e9 and source == "runtime.device = cpu: this machine's memory, 32 GB"


def test_stage_to_take_is_the_largest_that_fits():
    from dataclasses import replace

    from mesh.engine.plan import stage_to_take, stages_that_fit

    base = plan(load_config([], []))[0]
    cells = [replace(base, stage=j, weights_bytes=w) for j, w in enumerate([5, 9, 7, 9])]
    extra = base.total_bytes - base.weights_bytes
    assert stages_that_fit(cells, extra + 8) == [0, 2]
    assert stage_to_take(cells, extra + 8) == 2
    assert stage_to_take(cells, extra + 9) == 1  # a tie: the lower stage
    assert stage_to_take(cells, extra + 4) is None


def test_a_pooled_streams_stash_is_planned_at_its_largest_window():
    from mesh import choices
    from mesh.engine.plan import inflight_microbatches, stash_versions

    def cfg(stream_window: str):
        pools = ["pipeline.routing='pools'", "pipeline.pool_window=3", "grid.stages=2"]
        return load_config([], [*pools, f"pipeline.pool_stream_window={stream_window}"])

    auto, window, fixed = cfg("'auto'"), cfg("'window'"), cfg("5")
    assert inflight_microbatches(auto, 0) == choices.STREAM_WINDOW_CAP * 3
    assert stash_versions(auto, 0) == choices.STREAM_WINDOW_CAP * 3 + 1
    assert inflight_microbatches(window, 0) == 3 and inflight_microbatches(fixed, 0) == 5
    # a cell after the streams holds at most pool_window whatever the streams do
    assert {inflight_microbatches(c, 1) for c in (auto, window, fixed)} == {3}


def test_an_auto_stream_window_is_planned_at_what_fits_the_memory():
    """At llama-1b, 4 stages, `auto` holds 4x pool_window microbatches at most, a stashed weight
    version each: on a 24 GB card stage 0 holds fewer, as many as fit, and `plan --memory-gb`
    plans that many."""
    import json

    from mesh import choices
    from mesh.engine.plan import auto_window

    model = "configs/models/llama-1b.toml"
    sets = ["pipeline.routing='pools'", "pipeline.pool_stream_window='auto'", "grid.stages=4"]
    cfg = load_config([model], sets)
    floor = cfg.pipeline.pool_window
    cap = choices.STREAM_WINDOW_CAP * floor
    assert auto_window(cfg, 0, None) == cap and plan_cell(cfg, 0).versions == cap + 1
    fits = auto_window(cfg, 0, 24e9)
    assert floor < fits < cap
    bounded = plan_cell(cfg, 0, 24e9)
    assert bounded.versions == fits + 1 and bounded.inflight == fits
    assert bounded.total_bytes <= 24e9  # it fits, and one microbatch more would not
    tokens = 8 * cfg.pipeline.microbatch_size * cfg.model.seq_len
    assert bounded.total_bytes + 4 * bounded.params + tokens > 24e9
    args = ["plan", "--config", model, "--memory-gb", "24", "--json"]
    res = CliRunner().invoke(main, [*args, *(a for kv in sets for a in ("--set", kv))])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["cells"][0]["versions"] == fits + 1


def test_an_auto_cell_window_is_planned_at_its_largest_that_fits():
    """pool_cell_window = auto: a cell after the streams may hold up to 4x pool_window (a
    stashed version and its input activation each): plan counts that many, fewer where they
    would not fit the memory; with `window` it holds pool_window."""
    from mesh import choices
    from mesh.engine.plan import auto_window, held_input_bytes, inflight_microbatches

    model = "configs/models/llama-1b.toml"
    sets = ["pipeline.routing='pools'", "grid.stages=4"]
    fixed = load_config([model], sets)
    auto = load_config([model], [*sets, "pipeline.pool_cell_window='auto'"])
    floor = auto.pipeline.pool_window
    cap = choices.STREAM_WINDOW_CAP * floor
    assert inflight_microbatches(fixed, 1) == floor and inflight_microbatches(auto, 1) == cap
    assert inflight_microbatches(auto, 0) == floor  # the streams keep their own window
    fits = auto_window(auto, 1, 20e9)
    assert floor < fits < cap
    bounded = plan_cell(auto, 1, 20e9)
    assert bounded.inflight == fits and bounded.total_bytes <= 20e9
    one_more = 4 * bounded.params + held_input_bytes(auto, 1)
    assert bounded.total_bytes + one_more > 20e9
    # the same key hashes away at its default: every earlier run keeps its fingerprint
    assert (
        fixed.fingerprint()
        == load_config([model], [*sets, "pipeline.pool_cell_window='window'"]).fingerprint()
        != auto.fingerprint()
    )
