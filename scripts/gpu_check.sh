#!/usr/bin/env bash
# The CUDA path on one GPU, in one run of under 8 minutes (sized for an H200: 141 GB, 16 cores).
# Each part runs under its own time limit (seconds, below); a part that fails or runs out is
# recorded and the next one runs:
#   setup    75  the carried wheels installed if packages are missing (30 s; see below), then
#                imports, GPU, p2pd, corpus, versions (30 s) and `meshtrain --help` (15 s):
#                a failure here stops the run
#   model   160  `bench model --device cuda`, per stage of llama-1b and llama-160m, fp32 and
#                bf16: cell against plain torch, tokens/s, MFU against the bf16 peak in
#                mesh/bench/model.py (H200: 989 TFLOP/s dense), max_memory_allocated vs plan
#   codecs   25  every codec on the GPU on 256 MB of fp32 values: error, encode/decode MB/s
#   grid    140  the llama-160m 4x2 grid as 8 cell processes sharing the GPU, bf16 compute,
#                bf16 then fp8 payloads (70 s each: start, 20 steps, validation on the CPU at
#                the start and the end, one checkpoint per cell). Backend torch: its transport
#                is gloo over 127.0.0.1 for every message (comms/torchdist), payloads staged
#                through host memory; NCCL is not used (it refuses two ranks on one GPU anyway).
#   export   30  the bf16 run exported (transformers' layout), then `generate` samples it
#   hivemind 50  a llama-160m 2x2 grid over the hivemind backend (libp2p, p2pd), 10 steps
# Total 480 s at most, plus a few seconds to pack what comes back.
#
# On the device machine (it has no package registry): run scripts/gpu_wheels.sh here first, then
# with the device tool: command `scripts/gpu_check.sh`, carry [".whl"]. The wheels go to
# /tmp/site, meshtrain runs from this checkout (PYTHONPATH; `meshtrain` = `python3 -m cli.main`).
# Results: results/gpu/ (log.txt, parts.tsv, device.txt, codecs, grids, export, sample,
# summary.json, nvidia-smi.csv) and results/model-cuda/; with $OUT set (the device tool) also
# $OUT/summary.md, $OUT/log.txt and $OUT/results.tgz (both folders and the runs' small files;
# unpack it in the repo root). To rerun some parts after a fix: GPU_CHECK_PARTS="codecs export"
# with the earlier results/gpu/ in the checkout.
#
# GPU_CHECK_DRY=1: the same plumbing on the CPU with tiny models and a few steps (budgets x8),
# results under /tmp/gpu-check-dry unless GPU_CHECK_RESULTS / GPU_CHECK_RUNS say otherwise
# (tests/integration/test_gpu_check.py runs it).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${GPU_CHECK_DRY:-0}
wheels=${GPU_WHEELS:-.whl} site=${GPU_SITE:-/tmp/site}
if [ "$dry" = 1 ]; then
  root=${GPU_CHECK_RESULTS:-/tmp/gpu-check-dry/results}
  runs=${GPU_CHECK_RUNS:-/tmp/gpu-check-dry/runs}
  device=cpu scale=${GPU_CHECK_SCALE:-8} # a shared 2-core box: the budgets only catch hangs
  # a 0.3M-parameter Llama (export writes Llama only) on the byte corpus
  model=(--config configs/models/llama-20m.toml --set model.d_model=64 --set model.n_heads=4
    --set model.n_kv_heads=2 --set model.intermediate_size=128 --set model.vocab_size=256
    --set model.seq_len=64)
  bench=(--quick --preset tiny)
  codec_values=$((1 << 20))
  steps=4 hm_steps=4 microbatch=8
  grid=2x2 # the plumbing is the same at any shape: half the processes of the GPU's 4x2
else
  root=${GPU_CHECK_RESULTS:-results}
  runs=${GPU_CHECK_RUNS:-runs}
  device=cuda scale=1
  model=(--config configs/models/llama-160m.toml)
  bench=(--preset llama-1b --preset llama-160m) # llama-1b first: its rows are the target's
  codec_values=$((64 << 20))                    # 256 MB of fp32
  steps=20 hm_steps=10 microbatch=4
  grid=4x2
fi
res=$root/gpu
# GPU_CHECK_PARTS="grid-fp8 hivemind": setup and these parts only, added to the results there
only=${GPU_CHECK_PARTS:-}
[ -n "$only" ] || rm -rf "$res" "$root/model-cuda" "$runs"/gpu-*
mkdir -p "$res" "$runs"
[ -f "$res/parts.tsv" ] || printf 'part\tbudget_s\twall_s\texit\n' >"$res/parts.tsv"
exec > >(tee -a "$res/log.txt") 2>&1
mt=(python3 -m cli.main)
export PYTHONUNBUFFERED=1 # the log in the order things happened

part() { # part NAME BUDGET_S STDOUT_FILE CMD...: CMD under its budget; stdout also to the file
  local name=$1 budget=$(($2 * scale)) file=$3 t0=$SECONDS rc
  shift 3
  [ -z "$only" ] || [ "$name" = setup ] || [[ " $only " = *" $name "* ]] || return 0
  echo "== $name (budget $budget s)"
  { timeout -k 10 "$budget" "$@" 2>&3 | tee "$file"; } 3>&2
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$budget" $((SECONDS - t0)) "$rc" >>"$res/parts.tsv"
  [ "$rc" = 0 ] || echo "!! $name: exit $rc$([ "$rc" = 124 ] && echo ', over its budget')"
  return "$rc"
}

pack() { # what comes back from the device tool: 3 files (its limit: 8 of 16 MiB)
  [ -n "${OUT:-}" ] || return 0
  python3 - "$res" "$root/model-cuda" >"$OUT/summary.md" <<'PY'
import sys
from pathlib import Path
for d in map(Path, sys.argv[1:]):
    for f in sorted(d.glob("*")):
        if f.suffix in (".md", ".txt", ".tsv") and f.name != "log.txt":
            print(f"## {f}\n\n{f.read_text()}\n")
PY
  cp "$res/log.txt" "$OUT/log.txt"
  # the runs without their checkpoints (GBs): config, metrics, summaries
  find "$runs" -path "$runs/gpu-*" -type f ! -path '*/checkpoints/*' ! -name '*.safetensors' \
    -size -4M -print0 2>/dev/null |
    tar -czf "$OUT/results.tgz" "$res" "$root/model-cuda" --null -T - 2>/dev/null
}

smi=
if command -v nvidia-smi >/dev/null; then # the GPU's load and memory once a second, all along
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw,clocks.sm \
    --format=csv -l 1 >"$res/nvidia-smi.csv" 2>&1 &
  smi=$!
fi
trap '[ -z "$smi" ] || kill "$smi"; pack' EXIT

setup() {
  if ls "$wheels"/*.whl >/dev/null 2>&1 &&
    ! python3 -c "import hivemind, pydantic, tomli_w, shksprdata" 2>/dev/null; then
    echo "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site"
    timeout 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" "$wheels"/*.whl || return
  fi
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
  part setup 30 "$res/device.txt" python3 - "$device" <<'PY' || return
import importlib.metadata as md, os, platform, subprocess, sys, torch
import comms, hivemind, mesh, cli  # noqa: F401: what every part needs
from mesh.data.corpus import shakespeare_documents
print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cpus")
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "torch sees no GPU"
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
          f"sm_{p.major}{p.minor}, CUDA {torch.version.cuda}")
p2pd = os.path.join(os.path.dirname(hivemind.__file__), "hivemind_cli", "p2pd")
assert os.access(p2pd, os.X_OK), f"{p2pd} is not executable"
subprocess.run([p2pd, "-h"], capture_output=True, timeout=10)  # it starts on this machine
print(f"corpus: {len(shakespeare_documents())} documents; p2pd: {p2pd}")
versions = []
for name in ("hivemind pydantic pydantic-core tomli-w shakespeare numpy tokenizers click tqdm "
             "safetensors protobuf cryptography transformers").split():
    try:
        versions.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        versions.append(f"{name} (none)")
print(", ".join(versions))
PY
  timeout 15 "${mt[@]}" --help >/dev/null || return
}
if ! setup; then
  echo "!! setup failed: nothing else runs"
  exit 3
fi

part model 160 "$res/model.md" "${mt[@]}" bench model --device "$device" "${bench[@]}" \
  --out "$root/model-cuda"

CODEC_VALUES=$codec_values part codecs 25 "$res/codecs.md" python3 - "$device" "$res" <<'PY'
import json, os, sys
from pathlib import Path
from mesh.bench.comms import bench_codecs
from mesh.report import format_table
device, n = sys.argv[1], int(os.environ["CODEC_VALUES"])
rows = bench_codecs(quick=False, device=device, n=n)
json.dump({"device": device, "values": n, "codecs": rows},
          open(Path(sys.argv[2]) / "codecs.json", "w"), indent=2)
print(f"Every codec on {n:,} random normal fp32 values ({4 * n / 2**20:.0f} MB) on {device}; "
      "relative error per value, MB/s of fp32 input, best of 7.\n")
print(format_table(
    ["codec", "bytes/value", "rel err median", "rel err max", "encode MB/s", "decode MB/s"],
    [[r["name"], f"{r['bytes_per_value']:.3f}", f"{r['rel_err_median']:.2e}",
      f"{r['rel_err_max']:.2e}", f"{r['encode_mb_s']:,.0f}", f"{r['decode_mb_s']:,.0f}"]
     for r in rows]))
PY

common=("${model[@]}" --grid "$grid" --steps "$steps" --backend torch
  --set runtime.precision='"bf16"' --set runtime.device="\"$device\""
  --set pipeline.microbatch_size="$microbatch" --set run.eval_every="$steps"
  --set data.val_batches=2 --set checkpoint.every=0) # one checkpoint, at the clean stop
part grid-bf16 70 "$res/grid-bf16.md" "${mt[@]}" simulate "${common[@]}" \
  --set pipeline.codec='"bf16"' --out "$runs/gpu-160m-bf16"
part grid-fp8 70 "$res/grid-fp8.md" "${mt[@]}" simulate "${common[@]}" \
  --set pipeline.codec='"fp8_e4m3"' --out "$runs/gpu-160m-fp8"
part export 15 "$res/export.md" "${mt[@]}" export "$runs/gpu-160m-bf16" --out "$runs/gpu-160m-hf" &&
  part generate 15 "$res/sample.txt" "${mt[@]}" generate "$runs/gpu-160m-hf" --prompt "ROMEO:" \
    --max-new-tokens 100 --temperature 0.8

part hivemind 50 "$res/grid-hivemind.md" "${mt[@]}" simulate "${model[@]}" --grid 2x2 \
  --steps "$hm_steps" --backend hivemind --set runtime.precision='"bf16"' \
  --set runtime.device="\"$device\"" --set pipeline.microbatch_size="$microbatch" \
  --set run.eval_every="$hm_steps" --set data.val_batches=2 --out "$runs/gpu-160m-hivemind"

python3 - "$res" <<'PY'
import csv, json, sys
from pathlib import Path
res = Path(sys.argv[1])
parts = list(csv.DictReader(open(res / "parts.tsv"), delimiter="\t"))
summary = {
    "device": (res / "device.txt").read_text().splitlines(),
    "parts": [{k: (v if k == "part" else int(v)) for k, v in p.items()} for p in parts],
    "codecs": json.loads((res / "codecs.json").read_text()) if (res / "codecs.json").exists() else None,
}
(res / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
latest = {p["part"]: p for p in parts}  # a GPU_CHECK_PARTS rerun's row replaces the earlier one
print(f"{sum(p['exit'] == '0' for p in latest.values())} of {len(latest)} parts passed:")
for p in latest.values():
    print(f"  {p['part']:10s} {p['wall_s']:>4s} s of {p['budget_s']:>4s}  exit {p['exit']}")
sys.exit(any(p["exit"] != "0" for p in latest.values()))
PY
rc=$?
echo "done: $res/ and $root/model-cuda/"
exit $rc
