"""The `trainstack` command line. Each command lives in its own module under trainstack/cli/commands/ and
adds itself through `register(app)`; this file only lists them and turns user mistakes into one line.

Command modules keep heavy imports (boto3, aws_cdk, torch, matplotlib) inside their functions so that
`trainstack --help` stays fast.
"""

from __future__ import annotations

import errno
import importlib
import sys
from typing import Annotated, Any

import typer

# typer (pinned) vendors its own click: its usage errors are these classes, not the `click` package's.
from typer._click.exceptions import ClickException, NoArgsIsHelpError
from typer.core import TyperGroup

from trainstack.errors import TrainstackError

# One entry per command module; each exposes `register(app: typer.Typer) -> None`.
COMMAND_MODULES = [
    "trainstack.cli.commands.recipes",
    "trainstack.cli.commands.recipe_from_hf",
    "trainstack.cli.commands.plan",
    "trainstack.cli.commands.show",
    "trainstack.cli.commands.validate",
    "trainstack.cli.commands.schema",
    "trainstack.cli.commands.diff",
    "trainstack.cli.commands.status",
    "trainstack.cli.commands.logs",
    "trainstack.cli.commands.launch",
    "trainstack.cli.commands.tune",
    "trainstack.cli.commands.runs",
    "trainstack.cli.commands.stop_resume",
    "trainstack.cli.commands.checkpoints",
    "trainstack.cli.commands.export",
    "trainstack.cli.commands.emulator",
    "trainstack.cli.commands.data",
]


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _fail(message: str, exit_code: int = 2) -> typer.Exit:
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    return typer.Exit(exit_code)


def _usage(error: ClickException) -> BaseException:
    """A usage mistake (unknown option, missing argument, bad value) as one line, with where to look."""
    if isinstance(error, NoArgsIsHelpError):  # `trainstack` alone: the help, on stdout like -h
        typer.echo(error.ctx.get_help())
        return typer.Exit(error.exit_code)
    ctx = getattr(error, "ctx", None)
    where = f" (see `{ctx.command_path} -h`)" if ctx is not None else ""
    return _fail(error.format_message().rstrip(".") + where, error.exit_code)


class _Commands(TyperGroup):
    """Runs a command; user mistakes become one line on stderr and a non-zero exit (no traceback):
    a TrainstackError or usage error (exit 2), a file that cannot be read or written (exit 2), an AWS
    client error that a command did not explain itself (exit 2, via trainstack.aws.session.explain).
    Every command's recipe, --team and --set parameters complete in the shell (trainstack.cli.completion)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from trainstack.cli.completion import attach

        attach(self)

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except ClickException as error:  # e.g. `trainstack --bogus`
            raise _usage(error) from None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except TrainstackError as error:
            raise _fail(_one_line(error), error.exit_code) from None
        except ClickException as error:
            raise _usage(error) from None
        except OSError as error:
            if error.errno == errno.EPIPE:  # `trainstack ... | head`: typer exits quietly
                raise
            what = f"{error.filename}: " if error.filename else ""
            raise _fail(f"{what}{error.strerror or _one_line(error)}") from None
        except Exception as error:
            if type(error).__module__.split(".")[0] != "botocore":
                raise  # a bug: keep the traceback
            from trainstack.aws.session import explain

            raise _fail(f"AWS request failed: {explain(error)}") from None


app = typer.Typer(
    cls=_Commands,
    name="trainstack",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click formatting: reflows docstring paragraphs (rich kept source line breaks)
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120},
)


# One line per paragraph: the help renderer keeps a docstring's line breaks, so wrapped source lines
# would show as ragged lines in the terminal.
ROOT_HELP = "\n\n".join(
    (
        "Plan, validate and launch LLM training recipes on SageMaker P6-B200.",
        "Recipes are YAML files in recipes/ (a name such as 30b-fp8, or a path). Team files in "
        "recipes/teams/<team>/ layer on top (--team), then --set key.path=value overrides.",
        "Errors are one line on stderr starting with `error:`; exit status 2 for invalid input or an "
        "environment problem (no AWS credentials, no emulator), 1 where a command says so (plan: does "
        "not fit). `trainstack COMMAND -h` shows each command's options and examples.",
        "Shell completion of recipe names, teams and --set keys: `trainstack --install-completion` "
        "(bash, zsh, fish), then open a new shell.",
    )
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("trainstack")
    except PackageNotFoundError:  # run from a checkout without `pip install -e .`
        return "unknown (not installed: run `make setup`)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"trainstack {version()}")
        raise typer.Exit(0)


@app.callback(help=ROOT_HELP)
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", is_eager=True, callback=_print_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    pass


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
