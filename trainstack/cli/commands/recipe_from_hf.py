"""`trainstack recipe from-hf PATH`: the recipe `model:` block for a Hugging Face config.json."""

from __future__ import annotations

from typing import Annotated

import typer

recipe_app = typer.Typer(
    name="recipe",
    help="Write recipe parts from other formats (beside `trainstack recipes`, which lists them).",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(recipe_app)


@recipe_app.command("from-hf")
def from_hf(
    path: Annotated[str, typer.Argument(help="a Hugging Face config.json, or the folder holding it")],
    init_from: Annotated[
        str | None,
        typer.Option(
            "--init-from",
            help="also set model.init_from (an s3:// prefix or a local folder holding this config and its "
            "safetensors): the run starts from these weights",
        ),
    ] = None,
) -> None:
    """Print the recipe `model:` block for a Hugging Face model (Llama, Qwen2, Mistral-style).

    Paste it into a recipe; with --init-from the run continues pretraining from those weights
    (docs/models.md). What this trainer cannot represent is refused in one line, exit 2: mixtures of
    experts, sliding-window attention, RoPE scalings other than llama3, other activations or architectures.

    Example: trainstack recipe from-hf ~/models/Qwen2.5-32B/config.json --init-from s3://my-models/Qwen2.5-32B/
    """
    from trainstack.recipes.hf_config import (
        ARCHITECTURES,
        read_hf_config,
        recipe_model_block,
        shape_from_hf_config,
    )

    config, where = read_hf_config(path)
    shape = shape_from_hf_config(config, where)
    if init_from is not None:
        _check_init_from(init_from, shape)
    listed = config.get("architectures")
    # The model type decides what the trainer builds; `architectures` is only shown, when it is a name.
    architecture = (
        listed[0] if isinstance(listed, list) and listed and isinstance(listed[0], str) else None
    ) or ARCHITECTURES[config["model_type"]]
    from trainstack.recipes.schema import ModelShape

    params = ModelShape(**shape).total_params
    size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
    typer.echo(f"# {where}: {config['model_type']} ({architecture}), {size} parameters")
    typer.echo(recipe_model_block(shape, init_from))


def _check_init_from(init_from: str, shape: dict) -> None:
    """Refuse, in one line, an --init-from the printed recipe could not hold (an ftp:// URL, a path with a
    space: `validate` would refuse the recipe) or a local folder that does not exist."""
    from pathlib import Path

    from pydantic import ValidationError

    from trainstack.errors import TrainstackError
    from trainstack.recipes.schema import ModelShape

    try:
        ModelShape.model_validate({**shape, "init_from": init_from})
    except ValidationError:
        raise TrainstackError(
            f"--init-from {init_from!r}: expected an s3://BUCKET/PREFIX/ of the model's folder or a local "
            "directory (a path without spaces or colons)"
        ) from None
    if not init_from.startswith("s3://") and not Path(init_from).is_dir():
        raise TrainstackError(f"--init-from {init_from}: no such directory")
