#!/usr/bin/env bash
# The CUDA path in one go (under 8 minutes on one H100/H200-class GPU), from a clean checkout
# with `pip install -e '.[test]'` done:
#   1. `meshtrain bench model` on CUDA: every stage of llama-20m and llama-160m, fp32 and bf16,
#      with MFU and torch.cuda.max_memory_allocated against `meshtrain plan`
#   2. the fp8 and bf16 codecs on the device: round-trip error and encode+decode time
#   3. the llama-160m 4x2 grid as 8 cell processes on the GPU (torch backend), bf16 compute,
#      once with bf16 and once with fp8 payloads between stages, then export + generate
# Everything lands in results/gpu/ (and results/model-cuda/); commit those two folders.
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/gpu
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.cuda.get_device_name())" \
  | tee "$out/device.txt"

echo "== 1. bench model on CUDA (budget 180 s)"
timeout 180 meshtrain bench model --device cuda --out results/model-cuda

echo "== 2. codecs on the device (budget 60 s)"
timeout 60 python3 - <<'PY' | tee "$out/codecs.md"
import time, torch
from comms import codecs
from mesh.bench.report import format_table
x = torch.randn(64 * 2**20, device="cuda")  # 256 MB of fp32 activations
rows = []
for codec in ("bf16", "fp8_e4m3", "fp8_e5m2"):
    codecs.roundtrip(x, codec)  # warm-up
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(10):
        y = codecs.roundtrip(x, codec)
    torch.cuda.synchronize(); ms = (time.perf_counter() - t0) / 10 * 1e3
    rel = ((y - x).norm() / x.norm()).item()
    enc = codecs.encode(x, codec)
    assert enc.nbytes < x.numel() * 4 and rel < 0.1, (codec, rel)
    rows.append([codec, f"{enc.nbytes / x.numel():.3f}", f"{rel:.2e}", f"{ms:.2f}",
                 f"{x.numel() * 4 / ms / 1e6:.1f}"])
print(format_table(["codec", "bytes/value", "relative error", "encode+decode ms", "GB/s"], rows))
PY

echo "== 3. llama-160m 4x2 grid, cell processes on the GPU (budget 2 x 100 s)"
common=(--config configs/models/llama-160m.toml --backend torch --steps 20
        --set runtime.precision='"bf16"' --set runtime.device='"cuda"'
        --set pipeline.microbatch_size=4 --set run.eval_every=20 --set data.val_batches=2
        --set runtime.checkpoint_every=10)
rm -rf runs/gpu-160m-bf16 runs/gpu-160m-fp8
timeout 100 meshtrain simulate "${common[@]}" --set pipeline.codec='"bf16"' --out runs/gpu-160m-bf16 \
  | tee "$out/grid-bf16.md"
timeout 100 meshtrain simulate "${common[@]}" --set pipeline.codec='"fp8_e4m3"' --out runs/gpu-160m-fp8 \
  | tee "$out/grid-fp8.md"
timeout 60 meshtrain export runs/gpu-160m-bf16 --out runs/gpu-160m-hf | tee "$out/export.md"
timeout 60 meshtrain generate runs/gpu-160m-hf --prompt "ROMEO:" --max-new-tokens 100 --temperature 0.8 \
  | tee "$out/sample.txt"
echo "done: results/gpu/ and results/model-cuda/"
