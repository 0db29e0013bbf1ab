"""Memory stays bounded whatever the data's size: preparing 200 MB of generated text (peak RSS),
and training on a prepared dataset, whose shards are memory maps. Each is measured in its own
process.

Training is measured by its anonymous memory (RssAnon): the pages of a memory map that a
process has touched count in its RSS too (RssFile), but they are the kernel's page cache, shared
and dropped under memory pressure; what must not follow the dataset is the memory the process
itself holds (a corpus read into RAM would show there at once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.testing.local_peers import generated_text

pytestmark = [pytest.mark.integration, pytest.mark.slow]

INPUT_MB = 200
PREPARE_RSS_LIMIT_MB = 1024
HANG_S = 600  # only against a hang

PREPARE = """
import json, resource, sys, time
from cli.main import main
t = time.perf_counter()
try:
    main(["data", "prepare", *sys.argv[2:], "--out", sys.argv[1]], standalone_mode=False)
finally:
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"wall_s": wall, "rss_mb": rss}))
"""

TRAIN = """
import json, resource, sys
from mesh.config import load_config
from mesh.engine.sim import GridSim
from mesh.data.corpus import load_corpus, train_batch
cfg = load_config([], ["model.n_layers=2", "model.d_model=16", "model.n_heads=2",
    "model.seq_len=128", "grid.stages=2", "grid.replicas=2", "run.steps=3",
    "data.val_batches=4", "data.path=" + json.dumps(sys.argv[1])])
corpus = load_corpus(cfg.data.path, 0.05, 128, cfg.data.digest)
for index in range(2000):  # windows all over the dataset
    train_batch(corpus, 0, index % 2, index, 8, 128)
GridSim(cfg, corpus).run()
status = dict(ln.split(":", 1) for ln in open("/proc/self/status").read().splitlines())
kb = lambda key: int(status[key].split()[0]) / 1024
print("RESULT " + json.dumps({"anon_mb": kb("RssAnon"), "file_mb": kb("RssFile"),
                              "tokens": len(corpus.train)}))
"""


def _run(code: str, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _write_input(directory: Path, mb: int) -> int:
    """`mb` MB of text: one long .txt document (a quarter) and .jsonl files of 4 KB documents."""
    directory.mkdir()
    docs = [json.dumps({"text": generated_text(4000, seed=i)}) + "\n" for i in range(64)]
    block = "".join(docs).encode()
    quarter = mb * 1_000_000 // 4
    with (directory / "long.txt").open("w") as f:
        text = generated_text(1_000_000, seed=99)
        for _ in range(quarter // len(text.encode())):
            f.write(text)
    for k in range(3):
        with (directory / f"part{k}.jsonl").open("wb") as f:
            for _ in range(quarter // len(block)):
                f.write(block)
    return sum(p.stat().st_size for p in directory.iterdir())


def test_prepare_and_training_memory_do_not_follow_the_data_size(tmp_path, record_property):
    size = _write_input(tmp_path / "in", INPUT_MB)
    big = _run(PREPARE, str(tmp_path / "big"), str(tmp_path / "in"))
    mb_per_s = size / 1e6 / big["wall_s"]
    record_property("prepare_mb_per_s", round(mb_per_s, 1))
    print(
        f"prepare: {size / 1e6:.0f} MB in {big['wall_s']:.1f} s ({mb_per_s:.1f} MB/s), "
        f"peak RSS {big['rss_mb']:.0f} MB"
    )
    assert big["rss_mb"] < PREPARE_RSS_LIMIT_MB
    small_in = tmp_path / "small.jsonl"
    small_in.write_text(
        "".join(json.dumps({"text": generated_text(4000, i)}) + "\n" for i in range(400))
    )
    _run(PREPARE, str(tmp_path / "small"), str(small_in))
    on_small = _run(TRAIN, str(tmp_path / "small"))
    on_big = _run(TRAIN, str(tmp_path / "big"))
    print(
        f"training: anonymous memory {on_small['anon_mb']:.0f} MB on {on_small['tokens']:,} "
        f"tokens, {on_big['anon_mb']:.0f} MB on {on_big['tokens']:,} (mapped shard pages "
        f"touched: {on_small['file_mb']:.0f} / {on_big['file_mb']:.0f} MB)"
    )
    assert on_big["tokens"] > 100 * on_small["tokens"]
    shard_mb = 2 * on_big["tokens"] / 1e6  # uint16
    assert on_big["anon_mb"] - on_small["anon_mb"] < 0.05 * shard_mb, (on_small, on_big)


def test_a_bpe_prepare_stays_bounded_too(tmp_path, record_property):
    """bpe:4096 on 50 MB: the BPE trains on a capped sample (32 MB) and text is tokenized in
    1 MB batches, so the peak is the same on 50 MB as on 200 MB (measured: 544 MB there)."""
    size = _write_input(tmp_path / "in", 50)
    run = _run(PREPARE, str(tmp_path / "ds"), str(tmp_path / "in"), "--tokenizer", "bpe:4096")
    mb_per_s = size / 1e6 / run["wall_s"]
    record_property("bpe_prepare_mb_per_s", round(mb_per_s, 1))
    print(
        f"prepare bpe:4096: {size / 1e6:.0f} MB in {run['wall_s']:.1f} s ({mb_per_s:.1f} MB/s), "
        f"peak RSS {run['rss_mb']:.0f} MB"
    )
    assert run["rss_mb"] < PREPARE_RSS_LIMIT_MB
