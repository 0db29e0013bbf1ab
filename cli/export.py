"""`meshtrain export RUN_DIR --out DIR`: a trained llama run as a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import click

from cli.options import user_errors


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Export directory.")
@click.option(
    "--replica",
    type=int,
    default=0,
    show_default=True,
    help="Which replica's weights (replicas differ by what averaging has not yet merged).",
)
@click.option(
    "--max-shard-size",
    default="2GB",  # mesh.runtime.export.MAX_SHARD_SIZE (not imported here: it loads torch)
    show_default=True,
    help="Largest weights file, as transformers' max_shard_size (5GB, 200MB, bytes); a bigger "
    "model is written in shards with model.safetensors.index.json.",
)
@user_errors
def export(run_dir: str, out: str, replica: int, max_shard_size: str) -> None:
    """Assemble the newest step that every stage of one replica has a checkpoint of into one
    directory that transformers.AutoModelForCausalLM.from_pretrained(DIR) loads: config.json,
    model.safetensors (or its shards and their index, past --max-shard-size) and the run's
    tokenizer files (none for the byte tokenizer). Streams stage by stage: it holds about one
    shard, not the model. Refuses (exit 2) when a stage has no checkpoint or the stages share
    no step."""
    from cli.report import print_table
    from mesh.runtime.export import export_run, parse_size

    done = export_run(
        Path(run_dir), Path(out), replica, parse_size(max_shard_size, "--max-shard-size")
    )
    print_table(
        ["out", "step", "replica", "parameters", "files"],
        [[str(done.out), done.step, done.replica, f"{done.params:,}", ", ".join(done.files)]],
    )
