"""Shell completion (bash, zsh, fish) for what a recipe command takes: recipe names (a team's own
variants with --team), team names and `--set` keys (and their values where the schema lists them).

`trainstack --install-completion` installs it for the current shell; `--show-completion SHELL` prints
the script. The completers are attached by parameter name to every command, including commands added
later by other modules, so a new command with a `recipe` argument or a `--team` / `--set` option
completes without extra code. A completer never raises: a broken recipe tree completes nothing.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any


def _recipes_dir(ctx: Any) -> Path | None:
    value = (ctx.params or {}).get("recipes_dir")
    return Path(value) if value else None


def recipe_names(ctx: Any, param: Any, incomplete: str) -> list[Any]:
    from typer._click.shell_completion import CompletionItem

    if "/" in incomplete or incomplete.endswith((".yaml", ".yml")):
        return [CompletionItem(incomplete, type="file")]  # a path: let the shell complete files
    try:
        from trainstack.recipes.loader import base_recipe_names, team_names, team_recipe_names

        root, team = _recipes_dir(ctx), (ctx.params or {}).get("team")
        names = team_recipe_names(team, root) if team in team_names(root) else base_recipe_names(root)
    except Exception:  # noqa: BLE001 (completion must never print a traceback into the shell)
        return []
    return [name for name in names if name.startswith(incomplete)]


def team_names(ctx: Any, param: Any, incomplete: str) -> list[str]:
    try:
        from trainstack.recipes.loader import team_names as teams

        return [team for team in teams(_recipes_dir(ctx)) if team.startswith(incomplete)]
    except Exception:  # noqa: BLE001
        return []


def _choices(annotation: Any) -> list[str]:
    """The values a field accepts when the schema lists them (Literal, bool)."""
    from trainstack.recipes.keys import alternatives

    out: list[str] = []
    for alternative in alternatives(annotation):
        if typing.get_origin(alternative) is typing.Literal:
            out += [str(v) for v in typing.get_args(alternative)]
        elif alternative is bool:
            out += ["true", "false"]
    return out


def set_keys(ctx: Any, param: Any, incomplete: str) -> list[str]:
    """`training.mi` -> `training.micro_batch=`; `precision.dtype=` -> `precision.dtype=bf16`, ..."""
    try:
        from trainstack.recipes.keys import leaf_fields, settable_keys

        if "=" in incomplete:
            key, _, value = incomplete.partition("=")
            return [f"{key}={c}" for c in _choices(leaf_fields().get(key)) if c.startswith(value)]
        return [f"{k}" if k.endswith(".") else f"{k}=" for k in settable_keys() if k.startswith(incomplete)]
    except Exception:  # noqa: BLE001
        return []


COMPLETERS = {"recipe": recipe_names, "team": team_names, "set_": set_keys}


def attach(command: Any) -> None:
    """Give every parameter named like a recipe, team or --set option its completer (recursively)."""
    for param in getattr(command, "params", []):
        completer = COMPLETERS.get(param.name)
        if completer is not None and getattr(param, "_custom_shell_complete", None) is None:
            param._custom_shell_complete = completer
    for sub in getattr(command, "commands", {}).values():
        attach(sub)
