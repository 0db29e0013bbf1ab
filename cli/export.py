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
@user_errors
def export(run_dir: str, out: str, replica: int) -> None:
    """Assemble the newest step that every stage of one replica has a checkpoint of into one
    directory that transformers.AutoModelForCausalLM.from_pretrained(DIR) loads: config.json,
    model.safetensors and the run's tokenizer files (none for the byte tokenizer). Refuses
    (exit 2) when a stage has no checkpoint or the stages share no step."""
    from cli.report import print_table
    from mesh.runtime.export import export_run

    done = export_run(Path(run_dir), Path(out), replica)
    print_table(
        ["out", "step", "replica", "parameters", "files"],
        [[str(done.out), done.step, done.replica, f"{done.params:,}", ", ".join(done.files)]],
    )
