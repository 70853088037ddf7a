"""`trainstack --version` and shell completion (bash, zsh, fish) of recipe names, team names and
`--set` keys and values, through the installed console script as a shell calls it."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from trainstack.recipes.loader import base_recipe_names, team_names

pytestmark = pytest.mark.fast

TRAINSTACK = str(Path(sys.executable).parent / "trainstack")


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TRAINSTACK, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_installed_version(flag):
    done = run(flag)
    assert done.returncode == 0 and done.stdout == f"trainstack {version('trainstack')}\n"


def complete(shell: str, words: str) -> list[str]:
    """What the shell's completion function would get for the command line `words` (cursor at end)."""
    env = {"_TRAINSTACK_COMPLETE": f"complete_{shell}"}
    if shell == "bash":
        parts = words.split(" ")
        env |= {"COMP_WORDS": words, "COMP_CWORD": str(len(parts) - 1)}
    else:
        env |= {"_TYPER_COMPLETE_ARGS": words}
        if shell == "fish":
            env["_TYPER_COMPLETE_FISH_ACTION"] = "get-args"
    done = run(**env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    if shell == "zsh":  # _arguments '*: :(("a" "b"))' or a list of "value":"help" pairs
        import re

        return re.findall(r'"([^"]+?)"', out.replace('\\"', ""))
    return [line.split("\t")[0] for line in out.splitlines() if line]


SHELLS = ["bash", "zsh", "fish"]


@pytest.mark.parametrize("shell", SHELLS)
def test_recipe_names_complete(shell):
    got = complete(shell, "trainstack plan 8b")
    assert set(got) == {n for n in base_recipe_names() if n.startswith("8b")}


@pytest.mark.parametrize("shell", SHELLS)
def test_team_names_complete(shell):
    got = complete(shell, "trainstack show 8b-fp8 --team ")
    assert set(got) >= set(team_names()) and set(got) <= set(team_names())


@pytest.mark.parametrize("shell", SHELLS)
def test_set_keys_and_their_listed_values_complete(shell):
    keys = complete(shell, "trainstack plan 8b-fp8 --set training.mi")
    assert set(keys) == {"training.micro_batch=", "training.min_lr_ratio="}
    values = complete(shell, "trainstack status 8b-fp8 --set precision.dtype=")
    assert set(values) == {"precision.dtype=bf16", "precision.dtype=fp8"}


def test_every_command_with_a_recipe_argument_completes_it():
    for command in ("plan", "show", "status", "logs", "launch"):
        assert "30b-fp8" in complete("bash", f"trainstack {command} 30"), command


@pytest.mark.parametrize("shell", SHELLS)
def test_show_completion_prints_the_script_for_each_shell(shell):
    done = run("--show-completion", shell, _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1")
    assert done.returncode == 0, done.stderr
    assert "_TRAINSTACK_COMPLETE" in done.stdout and f"complete_{shell}" in done.stdout
