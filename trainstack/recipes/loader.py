"""Read recipe files and layer them: base (with `extends`), then team files, then `--set` overrides.

    recipes/<name>.yaml                       base recipes
    recipes/teams/<team>/defaults.yaml        a team's defaults, applied to every recipe it runs
    recipes/teams/<team>/<name>.yaml          a team's override of one recipe, or a team-only
                                              variant (`extends: <base>`) when no base has that name

Every leaf value remembers which layer set it, so `trainstack show` can say where it came from and a
validation error names the file the bad value was written in.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainstack.errors import RecipeError
from trainstack.recipes import bounded_yaml
from trainstack.recipes import overrides as override_rules
from trainstack.recipes.overrides import SET_SOURCE, override_label, parse_set  # noqa: F401 (public here too)
from trainstack.recipes.schema import Recipe, team_name_problem

DEFAULT_RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
TEAM_DEFAULTS = "defaults.yaml"
TEAM_RECIPES_KEY = "recipes"  # defaults.yaml only: which base recipes the team deploys (default: all)
DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class ResolvedRecipe:
    recipe: Recipe
    team: str | None
    sources: dict[str, str] = field(default_factory=dict)  # dotted leaf path -> file that set it
    files: tuple[str, ...] = ()  # every file read, base first

    def source_of(self, path: str) -> str:
        return self.sources.get(path, DEFAULT_SOURCE)


@dataclass
class _Layer:
    source: str
    data: dict[str, Any]


def recipes_dir_or_default(recipes_dir: Path | str | None) -> Path:
    return Path(recipes_dir) if recipes_dir is not None else DEFAULT_RECIPES_DIR


def base_recipe_names(recipes_dir: Path | str | None = None) -> list[str]:
    return sorted(p.stem for p in recipes_dir_or_default(recipes_dir).glob("*.yaml"))


def team_names(recipes_dir: Path | str | None = None) -> list[str]:
    """The team directories under recipes/teams; a directory that is not a valid team name is refused."""
    teams = recipes_dir_or_default(recipes_dir) / "teams"
    names = sorted(p.name for p in teams.iterdir() if p.is_dir()) if teams.is_dir() else []
    for name in names:
        if (problem := team_name_problem(name)) is not None:
            raise RecipeError(_display(teams / name), None, f"{problem} (rename the directory)")
    return names


def team_recipe_names(team: str, recipes_dir: Path | str | None = None) -> list[str]:
    """Recipes a team deploys and validates: the base recipes its defaults select (`recipes:`, default
    every one) plus the team's own variants."""
    root = recipes_dir_or_default(recipes_dir)
    bases = set(base_recipe_names(root))
    own = {p.stem for p in (root / "teams" / team).glob("*.yaml") if p.name != TEAM_DEFAULTS}
    selected = team_selection(team, root)
    return sorted((bases if selected is None else set(selected)) | (own - bases))


def team_selection(team: str, recipes_dir: Path | str | None = None) -> list[str] | None:
    """The base recipes `recipes/teams/<team>/defaults.yaml` selects with `recipes: [...]`, or None
    (every base recipe). A name that is no base recipe, or a team override of a base recipe the team
    does not select, is a one-line RecipeError naming the file."""
    import difflib

    root = recipes_dir_or_default(recipes_dir)
    defaults = root / "teams" / team / TEAM_DEFAULTS
    if not _present(defaults):
        return None
    raw = read_yaml(defaults).get(TEAM_RECIPES_KEY)
    if raw is None:
        return None
    source = _display(defaults)
    bases = base_recipe_names(root)
    if not isinstance(raw, list) or not raw or not all(isinstance(n, str) for n in raw):
        raise RecipeError(
            source, TEAM_RECIPES_KEY, f"must be a list of base recipe names, e.g. [{', '.join(bases[:2])}]"
        )
    for name in raw:
        if name not in bases:
            close = difflib.get_close_matches(name, bases, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"base recipes: {', '.join(bases)}"
            raise RecipeError(source, TEAM_RECIPES_KEY, f"{name!r} is not a base recipe ({hint})")
    for override in sorted((root / "teams" / team).glob("*.yaml")):
        if override.stem in bases and override.stem not in raw:
            raise RecipeError(
                _display(override),
                None,
                f"overrides {override.stem}, which `{TEAM_RECIPES_KEY}:` in {source} does not select "
                "(add it there, or delete this file)",
            )
    return list(dict.fromkeys(raw))


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping from `path`, or a one-line RecipeError naming the file. Read within bounds (size,
    nesting, alias expansion, one document: trainstack.recipes.bounded_yaml), so no file can hang, exhaust
    memory or crash a command that reads recipes or team files."""
    source = _display(path)
    data = bounded_yaml.load_file(path, source)
    if data is None:
        raise RecipeError(source, None, "file is empty")
    if not isinstance(data, dict):
        raise RecipeError(source, None, f"expected a mapping of sections, got {_yaml_kind(data)}")
    return data


def _yaml_kind(value: Any) -> str:
    kinds = {list: "a list", str: "text", int: "a number", float: "a number", bool: "a boolean"}
    return kinds.get(type(value), type(value).__name__)


def _present(path: Path) -> bool:
    """Whether a directory entry exists at `path`, even one that cannot be read (a symlink loop, a broken
    link): such a file is read and refused in one line, never silently skipped."""
    return os.path.lexists(path)


def resolve(
    name_or_path: str,
    team: str | None = None,
    overrides: Sequence[str] = (),
    recipes_dir: Path | str | None = None,
    overrides_source: str = SET_SOURCE,
) -> ResolvedRecipe:
    """Load a recipe by name (from `recipes_dir`) or path, layer team files and overrides, validate.

    `overrides_source` is how errors and `show` name the overrides: `--set`, or `-c set` for the CDK app.
    """
    root = recipes_dir_or_default(recipes_dir)
    layers: list[_Layer] = []
    variant_alone = False
    is_path = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
    if team is not None and (problem := team_name_problem(team)) is not None:
        raise RecipeError("--team", None, problem)  # before any lookup: the name is in stack and job names
    team_dir = root / "teams" / team if team else None
    if team is not None and (team_dir is None or not team_dir.is_dir()):
        known = ", ".join(team_names(root)) or "none"
        raise RecipeError(_display(root / "teams"), "team", f"unknown team {team!r} (known: {known})")

    if is_path:
        layers += _extends_chain(Path(name_or_path), root)
        name = layers[-1].data.get("name", Path(name_or_path).stem)
    else:
        name = name_or_path
        base = root / f"{name}.yaml"
        team_variant = team_dir / f"{name}.yaml" if team_dir else None
        if _present(base):
            layers += _extends_chain(base, root)
        elif team_variant is not None and _present(team_variant):
            layers += _extends_chain(team_variant, root)
            _refuse_gates(layers[-1])  # the team's own file; its bases are not team-owned
            variant_alone = len(layers) == 1  # no `extends`: a whole recipe, or a misnamed override
        else:
            known = ", ".join(team_recipe_names(team, root) if team else base_recipe_names(root))
            owner = f" for team {team!r}" if team else ""
            raise RecipeError(_display(root), "recipe", f"unknown recipe {name!r}{owner} (known: {known})")

    if team_dir is not None:
        layers.append(_Layer(f"--team {team}", {"tags": {"team": team}}))
        defaults = team_dir / TEAM_DEFAULTS
        if _present(defaults):
            layer = _team_layer(defaults, name, may_extend=False)
            if TEAM_RECIPES_KEY in layer.data:  # refused here too, so every command refuses a bad one
                team_selection(team, root)
            layer.data.pop(TEAM_RECIPES_KEY, None)  # the team's selection, not a recipe value
            layers.append(layer)
        overlay = team_dir / f"{name}.yaml"
        already_read = {_real(Path(layer.source)) for layer in layers if "/" in layer.source}
        if _present(overlay) and _real(overlay) not in already_read:
            layers.append(_team_layer(overlay, name, may_extend=False))

    typed: list[tuple[str, str]] = []
    if overrides:
        tree, typed = override_rules.parse(overrides, overrides_source)
        layers.append(_Layer(overrides_source, tree))

    def merge(chosen: list[_Layer]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for layer in chosen:  # copies: _merge adopts the layer's own dicts, and this runs more than once
            _merge(merged, copy.deepcopy(layer.data))
        merged.pop("extends", None)
        merged["name"] = name if not is_path else merged.get("name", name)
        return merged

    sources: dict[str, str] = {}
    for layer in layers:
        for path in _leaf_paths(layer.data):
            sources[path] = layer.source
    try:
        recipe = Recipe.model_validate(merge(layers))
    except ValidationError as exc:
        given = Path(name_or_path)
        if is_path and team is None and given.parent.parent.name == "teams":  # a partial file alone
            recipe_name = "RECIPE" if given.name == TEAM_DEFAULTS else given.stem
            raise RecipeError(
                _display(given),
                None,
                f"a team file is not a whole recipe: use `{recipe_name} --team {given.parent.name}`",
            ) from None
        error = _first_error(exc, sources, layers[0].source)
        if variant_alone and any(e["type"] == "missing" for e in exc.errors()):
            raise _no_base_recipe(layers[0].source, name, root) from None
        if typed:
            files_only = [layer for layer in layers if layer.source != overrides_source]

            def valid_with(assignments: list[str]) -> bool:
                tree = override_rules.parse(assignments, overrides_source)[0]
                try:
                    Recipe.model_validate(merge([*files_only, _Layer(overrides_source, tree)]))
                except ValidationError:
                    return False
                return True

            error = override_rules.blame(error, typed, overrides_source, valid_with)
        raise error from None
    files = tuple(
        layer.source
        for layer in layers
        if layer.source != overrides_source and not layer.source.startswith("--")
    )
    return ResolvedRecipe(recipe=recipe, team=team, sources=sources, files=files)


def _no_base_recipe(source: str, name: str, root: Path) -> RecipeError:
    """A team file that matches no base recipe and extends none: most likely a misspelt override."""
    import difflib

    bases = base_recipe_names(root)
    close = difflib.get_close_matches(name, bases, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}.yaml?" if close else f"base recipes: {', '.join(bases)}"
    return RecipeError(
        source,
        None,
        f"matches no base recipe ({hint}); a team file overrides the base recipe of the same name, "
        "or is a team-only variant with `extends: <base recipe>`",
    )


def _extends_chain(path: Path, root: Path) -> list[_Layer]:
    """Layers from the furthest ancestor down to `path`, following `extends` by base-recipe name."""
    chain: list[_Layer] = []
    seen: list[str] = []
    current: Path | None = path
    while current is not None:
        key = str(_real(current))
        if key in seen:
            cycle = " -> ".join([_display(Path(p)) for p in seen] + [_display(current)])
            raise RecipeError(_display(path), "extends", f"cyclic extends: {cycle}")
        seen.append(key)
        data = read_yaml(current)
        chain.append(_Layer(_display(current), data))
        parent = data.get("extends")
        if parent is None:
            current = None
        elif not isinstance(parent, str) or not parent:
            raise RecipeError(_display(current), "extends", "must be the name of a base recipe")
        else:
            current = root / f"{parent}.yaml"
            if not _present(current):
                known = ", ".join(base_recipe_names(root))
                raise RecipeError(
                    _display(Path(chain[-1].source)),
                    "extends",
                    f"no base recipe named {parent!r} (known: {known})",
                )
    return list(reversed(chain))


# Team files are owned by teams (see docs/gitops.md); the security gates are not. A team file may not
# touch encryption, retention/removal or cdk-nag handling, whatever the recipe schema grows to hold:
# whole sections by top-level name, and any key with one of these names at any depth.
GATE_SECTIONS = frozenset(
    {
        "security",
        "storage",
        "encryption",
        "kms",
        "bucket",
        "repository",
        "nag",
        "cdk_nag",
    }
)
GATE_KEYS = frozenset(
    {
        "encryption",
        "encrypted",
        "encrypt",
        "kms",
        "kms_key",
        "kms_key_id",
        "kms_key_arn",
        "sse",
        "sse_algorithm",
        "enforce_ssl",
        "ssl",
        "versioned",
        "versioning",
        "block_public_access",
        "public_access",
        "removal_policy",
        "retain",
        "retention",
        "retention_days",
        "termination_protection",
        "deletion_protection",
        "auto_delete_objects",
        "nag",
        "cdk_nag",
        "nag_suppressions",
        "suppressions",
        "suppress",
        "acknowledgments",
        "acknowledge",
        "skip_nag",
    }
)
GATES_MESSAGE = (
    "a team file cannot change a security gate (encryption, retention, nag findings); "
    "they are fixed for every team"
)


def _team_layer(path: Path, name: str, may_extend: bool) -> _Layer:
    data = read_yaml(path)
    for key in ("name", "extends"):
        if key in data and not may_extend:
            raise RecipeError(
                _display(path), key, "a team override cannot set this; it layers onto the base recipe"
            )
    return _refuse_gates(_Layer(_display(path), data))


def _refuse_gates(layer: _Layer) -> _Layer:
    if gate := _gate_key(layer.data):
        raise RecipeError(layer.source, gate, GATES_MESSAGE)
    return layer


def _gate_key(tree: dict[str, Any], prefix: str = "") -> str | None:
    """The dotted path of the first key that touches a security gate (free-form tags aside), else None."""
    for key, value in tree.items():
        norm = str(key).lower().replace("-", "_")
        path = f"{prefix}{key}"
        if norm in GATE_KEYS or (not prefix and norm in GATE_SECTIONS):
            return path
        if isinstance(value, dict) and key != "extra" and (found := _gate_key(value, f"{path}.")):
            return found
    return None


def _merge(into: dict[str, Any], overlay: dict[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and key != "extra":
            _merge(into[key], value)
        else:
            into[key] = value


def _leaf_paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "extra":
            paths += _leaf_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def _first_error(exc: ValidationError, sources: dict[str, str], base_source: str) -> RecipeError:
    error = exc.errors()[0]
    path = ".".join(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if not path and (named := re.match(r"^([a-z_]+(?:\.[a-z_0-9]+)+): (.*)$", message)):
        path, message = named.groups()  # a cross-section check that names its own field
    elif error["type"] == "value_error" and (named := re.match(r"^([a-z_][a-z_0-9]*): (.*)$", message)):
        # a section check
        path, message = f"{path}.{named.group(1)}" if path else named.group(1), named.group(2)
    from trainstack.recipes import keys as recipe_keys

    if error["type"] == "extra_forbidden":
        message = "unknown key" + recipe_keys.did_you_mean(path)
    elif error["type"] == "missing":
        message = "required field is missing"
    elif error["type"] == "string_pattern_mismatch":
        words = recipe_keys.PATTERN_WORDS.get(path, "not in the expected form")
        message = f"{error.get('input')!r} is not {words}"
    elif error["type"] == "string_type" and isinstance(error.get("input"), int | float):
        value = error["input"]
        message = f"expected text, got the number {value!r}: quote it ('{value}') so YAML keeps it text"
    # The file that wrote the offending value, else the deepest layer that wrote anything under it.
    # Else the last layer that wrote a sibling in the same section (a section check or missing field).
    parent = path.rpartition(".")[0]
    source = (
        sources.get(path)
        or next(
            (src for p, src in reversed(list(sources.items())) if path and p.startswith(path + ".")), None
        )
        or next(
            (src for p, src in reversed(list(sources.items())) if parent and p.startswith(parent + ".")),
            base_source,
        )
    )
    return RecipeError(source, path or None, message)


def display_path(path: Path) -> str:
    """A path as errors show it: relative to the working directory when under it."""
    return _display(path)


def _display(path: Path) -> str:
    """Paths relative to the working directory when under it: short enough for one-line errors."""
    try:
        return str(_real(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _real(path: Path) -> Path:
    """`path` with symlinks resolved; a symlink loop (which `resolve` refuses with RuntimeError on
    Python 3.11, OSError later) stays as written, absolute, so reading it can name it in one line."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return path.absolute()
