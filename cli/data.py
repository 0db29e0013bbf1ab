"""`meshtrain data prepare` and `meshtrain data verify`: token datasets a run can train on.

prepare: inputs -> DIR (token shards, tokenizer, manifest.json; mesh/data/prepare.py) with a
progress bar over the input bytes, the rejected records by file and line, and a summary table.
verify: hash every shard of DIR against its manifest (what `--verify-data` does before a run).

imports: click, cli.options, cli.report, mesh.data (lazily: numpy, tokenizers, torch).
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from cli.options import user_errors
from cli.report import byte_bar, print_table


@click.group()
def data() -> None:
    """Token datasets: prepare text for training, verify a prepared one."""


@data.command()
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New dataset DIR.")
@click.option(
    "--tokenizer",
    default="bytes",
    show_default=True,
    metavar="SPEC",
    help="bytes (vocab 256 + end-of-text), PATH to a tokenizer.json, or bpe:VOCAB (a "
    "byte-level BPE trained on a sample of the inputs, saved into DIR).",
)
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    help="The text of a .jsonl / .parquet record.",
)
@click.option(
    "--val-fraction",
    type=float,
    default=0.05,
    show_default=True,
    help="Share of the text held out for validation, as whole documents.",
)
@click.option(
    "--shard-tokens",
    type=int,
    default=100_000_000,
    show_default=True,
    help="Tokens per shard file.",
)
@user_errors
def prepare(
    inputs: tuple[str, ...],
    out: str,
    tokenizer: str,
    text_field: str,
    val_fraction: float,
    shard_tokens: int,
) -> None:
    """Tokenize INPUT... (.txt, .jsonl, .jsonl.gz, .parquet files, directories, globs) into
    DIR: token shards read through memory maps, a validation split of whole documents, the
    tokenizer and manifest.json, whose digest is the dataset's identity. Train on it with
    --set data.path=DIR."""
    from mesh.data.prepare import prepare as run_prepare

    bars: list = []
    labels = {"sample": "reading a BPE sample", "tokenize": "tokenizing"}

    def on_phase(name: str, total: int) -> None:
        for b in bars:
            b.close()
        bars[:] = [byte_bar(total, labels[name])]

    start = time.perf_counter()
    try:
        manifest = run_prepare(
            list(inputs),
            out,
            tokenizer,
            text_field,
            val_fraction,
            shard_tokens,
            on_phase=on_phase,
            on_bytes=lambda n: bars[0].update(n) if bars else None,
        )
    finally:
        for b in bars:
            b.close()
    wall_s = time.perf_counter() - start
    rejects = manifest["rejects"]
    if rejects["count"]:
        reasons = ", ".join(f"{n} {why}" for why, n in rejects["by_reason"].items())
        click.echo(f"rejected {rejects['count']} records ({reasons}):", err=True)
        for line in rejects["examples"]:
            click.echo(f"  {line}", err=True)
    mb = manifest["sources"]["bytes"] / 1e6
    print_table(*summary_rows(manifest))
    click.echo(
        f"{mb:,.1f} MB in {wall_s:.1f} s ({mb / max(wall_s, 1e-9):,.1f} MB/s); "
        f"digest {manifest['digest'][:16]}; train on it with --set data.path={out}"
    )


def summary_rows(manifest: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["split", "documents", "text MB", "tokens", "bytes/token", "shards"]
    rows = []
    for split in ("train", "val"):
        s = manifest["splits"][split]
        rows.append(
            [
                split,
                f"{s['documents']:,}",
                f"{s['bytes'] / 1e6:,.2f}",
                f"{s['tokens']:,}",
                f"{s['bytes_per_token']:.3f}",
                str(len(s["shards"])),
            ]
        )
    tok = manifest["tokenizer"]
    rows.append(["tokenizer", tok["name"], "", f"vocab {tok['vocab_size']:,}", "", ""])
    return headers, rows


@data.command()
@click.argument("directory", type=click.Path(file_okay=False))
@user_errors
def verify(directory: str) -> None:
    """Hash every shard of a prepared DIR against its manifest (exit 2 naming one that
    differs); what `simulate` / `join` --verify-data do before training."""
    from mesh.data.corpus import load_corpus
    from mesh.data.manifest import verify_shards

    corpus = load_corpus(directory, 0.05, 1)  # the manifest and every shard's size
    assert corpus.manifest is not None
    total = sum(p.stat().st_size for p in Path(directory).glob("*.bin"))
    with byte_bar(total, "verifying") as bar:
        verify_shards(Path(directory), corpus.manifest, bar.update)
    click.echo(f"{directory}: every shard matches manifest digest {corpus.digest[:16]}")
