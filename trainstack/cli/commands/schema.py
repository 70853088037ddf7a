"""`trainstack schema`: the recipe JSON Schema, for editors to validate recipe files as people type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("schema")(schema)


def recipe_schema(partial: bool = False) -> dict:
    """The recipe's JSON Schema; `partial` drops every `required` list, for team files that set a few keys."""
    from trainstack.recipes.schema import Recipe

    schema = Recipe.model_json_schema()
    if partial:
        from trainstack.recipes.loader import TEAM_RECIPES_KEY, base_recipe_names

        schema = _without_required(schema)
        schema["properties"][TEAM_RECIPES_KEY] = {
            "type": "array",
            "items": {"enum": base_recipe_names()},
            "minItems": 1,
            "uniqueItems": True,
            "description": "defaults.yaml only: the base recipes this team deploys (default: every one)",
        }
    title = "trainstack team override" if partial else "trainstack recipe"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": title}


def _without_required(node):
    if isinstance(node, dict):
        return {k: _without_required(v) for k, v in node.items() if k != "required"}
    if isinstance(node, list):
        return [_without_required(v) for v in node]
    return node


def schema(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to this file instead of stdout.")
    ] = None,
    team_file: Annotated[
        bool, typer.Option("--team-file", help="The schema for team files (same keys, none required).")
    ] = False,
) -> None:
    """Print the JSON Schema of a recipe file (point your editor's YAML language server at it).

    Team files (recipes/teams/<team>/*.yaml) are partial recipes: use --team-file for them.

    Example: trainstack schema -o recipe.schema.json
    """
    text = json.dumps(recipe_schema(partial=team_file), indent=2) + "\n"
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
