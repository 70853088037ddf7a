"""`--set key.path=value` (and the CDK app's `-c set=...`): parsing, and naming the override behind an error.

Values are YAML scalars, except for text fields, which keep the text typed (`deploy.account=0123...`).
`name` and `extends` cannot be overridden. An error an override caused names that override as typed
(`--set training.micro_batch=3: training.global_batch: ...`), not the recipe file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from trainstack.errors import RecipeError
from trainstack.recipes import bounded_yaml
from trainstack.recipes import keys as recipe_keys

SET_SOURCE = "--set"


def override_label(source: str, assignment: str) -> str:
    """An override as the user typed it: `--set training.micro_batch=3`, `-c set=training.micro_batch=3`."""
    return f"{source}={assignment}" if source.startswith("-c") else f"{source} {assignment}"


def parse_set(assignments: Iterable[str], source: str = SET_SOURCE) -> dict[str, Any]:
    """`["training.micro_batch=4", ...]` -> nested dict. Values are parsed as YAML scalars, except for
    text fields (`deploy.account=123456789012` stays the text typed, not a YAML integer).

    `source` names where the assignments were typed (`--set`, or `-c set` for the CDK app) in errors."""
    return parse(assignments, source)[0]


def parse(assignments: Iterable[str], source: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The nested dict and, in order, (dotted key, assignment as typed) for each override."""
    tree: dict[str, Any] = {}
    typed: list[tuple[str, str]] = []
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError(source, None, f"{assignment!r} is not key.path=value")
        label = override_label(source, assignment)
        if key.split(".")[0] in recipe_keys.NOT_SETTABLE:
            what = key.split(".")[0]
            why = (
                "a recipe is named after its file (copy it under a new name, or add a team variant)"
                if what == "name"
                else "files layer with `extends:` inside a file (a team variant), not on the command line"
            )
            raise RecipeError(label, what, f"cannot be overridden: {why}")
        if recipe_keys.is_text(key):
            value: Any = raw
        else:
            value = bounded_yaml.load_value(raw, label, key) if raw.strip() else None
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RecipeError(label, key, f"conflicts with an earlier {source} of {part}")
            node = child
        node[leaf] = value
        typed.append((key, assignment))
    return tree, typed


def blame(
    error: RecipeError,
    typed: list[tuple[str, str]],
    source: str,
    valid_with: Callable[[list[str]], bool],
) -> RecipeError:
    """Name the override (as typed) behind a validation error, when an override caused it: the one that
    set the offending key, else the one(s) without which the files validate.

    `typed`: (dotted key, assignment) per override, from `parse`; `valid_with(assignments)`: whether the
    files validate with only these overrides on top."""
    path = error.field or ""
    field, message = error.field, error.message
    direct = [
        a for key, a in typed if path == key or path.startswith(f"{key}.") or key.startswith(f"{path}.")
    ]
    deeper = [key for key, _ in typed if key.startswith(f"{path}.")]
    if deeper and message.startswith("unknown key"):  # `trainig.steps`: name the key as typed
        field, message = deeper[0], "unknown key" + recipe_keys.did_you_mean(deeper[0])
    if not direct:
        if not valid_with([]):
            return error  # the files are invalid on their own: the file named is to blame
        direct = [a for _, a in typed if not valid_with([a])]
        direct = direct or [a for _, a in typed]  # only their combination fails
    label = ", ".join(override_label(source, a) for a in direct)
    return RecipeError(label, field, message)
