"""`meshtrain export RUN_DIR... --out DIR`: a trained llama run as a Hugging Face model directory
(a `train` run's node directories are read as one: mesh/runtime/node_dirs.py)."""

from __future__ import annotations

from pathlib import Path

import click

from cli.options import user_errors


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
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
def export(run_dirs: tuple[str, ...], out: str, replica: int, max_shard_size: str) -> None:
    """Assemble the newest step that every stage of one replica has a checkpoint of into one
    directory that transformers.AutoModelForCausalLM.from_pretrained(DIR) loads: config.json,
    model.safetensors (or its shards and their index, past --max-shard-size) and the run's
    tokenizer files (none for the byte tokenizer). Streams stage by stage: it holds about one
    shard, not the model. Refuses (exit 2) when a stage has no checkpoint or the stages share
    no step. Several RUN_DIRs: the node directories of one `train` run (each node's --out),
    read as one run directory."""
    from cli.report import print_table
    from mesh.runtime.export import export_run, parse_size
    from mesh.runtime.node_dirs import one_run_dir

    shard = parse_size(max_shard_size, "--max-shard-size")
    with one_run_dir([Path(d) for d in run_dirs], "export") as run_dir:
        done = export_run(run_dir, Path(out), replica, shard)
    if len(run_dirs) > 1:  # the provenance names the node directories, not the passing view
        note_node_dirs(Path(out), [Path(d) for d in run_dirs])
    print_table(
        ["out", "step", "replica", "parameters", "files"],
        [[str(done.out), done.step, done.replica, f"{done.params:,}", ", ".join(done.files)]],
    )


def note_node_dirs(out: Path, dirs: list[Path]) -> None:
    """meshtrain.json of an export read from node directories: run_dir is the first of them,
    node_dirs all of them."""
    import json

    from mesh.runtime.export import PROVENANCE

    path = out / PROVENANCE
    meta = json.loads(path.read_text())
    names = [str(d.resolve()) for d in dirs]
    meta.update(run_dir=names[0], node_dirs=names)
    path.write_text(json.dumps(meta, indent=2) + "\n")
