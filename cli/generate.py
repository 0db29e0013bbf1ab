"""`meshtrain generate (RUN_DIR | EXPORT_DIR) --prompt TEXT`: sample text from a trained model."""

from __future__ import annotations

import click

from cli.options import user_errors
from mesh.config import ConfigError


@click.command()
@click.argument("source", type=click.Path(file_okay=False, exists=True))
@click.option("--prompt", required=True, help="The text to continue.")
@click.option("--max-new-tokens", type=int, default=200, show_default=True)
@click.option(
    "--temperature", type=float, default=0.8, show_default=True, help="0: greedy (argmax)."
)
@click.option("--top-k", type=int, default=None, help="Sample among the k likeliest tokens.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--replica", type=int, default=0, show_default=True, help="RUN_DIR: whose weights.")
@user_errors
def generate(
    source: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    replica: int,
) -> None:
    """Continue PROMPT with the model of a run directory (the newest step every stage has a
    checkpoint of, as export takes it) or of an export directory. Prints the prompt and the
    sampled text; a line on stderr says where the weights came from."""
    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be at least 1")
    if top_k is not None and top_k < 1:
        raise ConfigError("--top-k must be at least 1")
    from mesh.model.generate import generate as sample
    from mesh.runtime.export import load_for_sampling

    cfg, model, tokenizer, where = load_for_sampling(source, replica)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ConfigError("--prompt is empty after tokenizing; give some text")
    click.echo(f"# {source}: {cfg.model.arch}, {where}", err=True)
    out = sample(
        [model], ids, max_new_tokens, cfg.model.seq_len, temperature, top_k, seed, tokenizer.eot_id
    )
    click.echo(prompt + tokenizer.decode(out))
