"""The `trainstack` command line. Each command lives in its own module under trainstack/commands/ and
adds itself through `register(app)`; this file only lists them and turns user mistakes into one line.

Command modules keep heavy imports (boto3, aws_cdk, torch, matplotlib) inside their functions so that
`trainstack --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer
from typer.core import TyperGroup

from trainstack.errors import TrainstackError

# One entry per command module; each exposes `register(app: typer.Typer) -> None`.
COMMAND_MODULES = [
    "trainstack.commands.recipes",
    "trainstack.commands.plan",
    "trainstack.commands.show",
    "trainstack.commands.validate",
    "trainstack.commands.schema",
    "trainstack.commands.diff",
    "trainstack.commands.status",
    "trainstack.commands.logs",
    "trainstack.commands.launch",
]


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class _Commands(TyperGroup):
    """Runs a command; a TrainstackError becomes one line on stderr and exit status 2 (no traceback)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except TrainstackError as error:
            typer.echo(f"error: {_one_line(error)}", err=True)
            raise typer.Exit(error.exit_code) from None


app = typer.Typer(
    cls=_Commands,
    name="trainstack",
    help="Plan, validate and launch LLM training recipes on SageMaker P6-B200.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    """Plan, validate and launch LLM training recipes on SageMaker P6-B200.

    Recipes are YAML files in recipes/ (a name such as 30b-fp8, or a path). Team files in
    recipes/teams/<team>/ layer on top (--team), then --set key.path=value overrides.
    """


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def main() -> None:
    """Console-script entry point (`trainstack`)."""
    try:
        app()
    except TrainstackError as error:  # raised outside a command, e.g. while parsing
        print(f"error: {_one_line(error)}", file=sys.stderr)
        sys.exit(error.exit_code)


if __name__ == "__main__":
    main()
