"""Bounded input (issue 18 item 7): every bad recipe, team file and `--set` value the issue lists, and
every bound of every number in the schema, is one line naming the file (or override) and the field,
exit status 2, no traceback, and fast, through the loader; a sample through each command that reads
recipes (plan, validate, show, recipes, launch, diff, the CDK app's config, shell completion) and the
installed console script.

Before the bounds: a self-containing anchor raised RecursionError, an alias bomb took 8 GB in 95 s, a
50 MB recipe gave no answer in 2 minutes, a symlink loop was a RuntimeError traceback, `.inf` prices
crashed the planner, `lr: .inf` and `node_mtbf_hours: 1e-300` passed, `1e20` steps planned 5.9e18 USD.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import annotated_types
import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.errors import TrainstackError
from trainstack.recipes import keys
from trainstack.recipes.loader import display_path, resolve
from trainstack.recipes.numbers import Max, Min
from trainstack.recipes.schema import Recipe

pytestmark = pytest.mark.fast

# Generous for what each case costs now (milliseconds) and far below what it cost before (RecursionError
# after seconds, minutes, unbounded): the loader's bound per case, and a fresh `trainstack` process's
# (its start-up is about 1 s on the 2-core sandbox).
LOADER_LIMIT_S = 1.0
PROCESS_LIMIT_S = 20.0
runner = CliRunner()

# The valid `small` recipe of tests/unit/conftest.py (the `recipes_dir` fixture writes it as small.yaml);
# a module-level copy because the cases below are built at import (and a `conftest` import would resolve
# to whichever conftest.py the session loaded first).
SMALL = """\
model: {layers: 2, hidden: 64, heads: 4, kv_heads: 2, ffn: 128, vocab: 1000}
training: {seq_len: 32, micro_batch: 1, global_batch: 8, steps: 10}
precision: {dtype: bf16}
activation_checkpointing: {mode: none}
parallelism: {shard_group: 8}
compute: {instance_type: ml.p6-b200.48xlarge}
"""
BASE = "name: bad\n" + SMALL


def _bomb(kind: str, levels: int = 9, width: int = 9) -> str:
    """The billion-laughs pattern: `levels` anchors, each `width` aliases of the one before."""
    if kind == "sequence":
        lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    else:
        lines = ["a0: &a0 {" + ", ".join(f"k{j}: x" for j in range(width)) + "}"]
        lines += [
            f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(width)) + "}"
            for i in range(1, levels)
        ]
    return "bomb:\n" + "".join(f"  {line}\n" for line in lines)


def _flow_bomb(levels: int = 9, width: int = 9) -> str:
    """The same on one line, as a `--set` value could be typed."""
    parts = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    parts += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "{" + ", ".join(parts) + "}"


def _text(body: str | bytes) -> Callable[[Path], Path]:
    def make(root: Path) -> Path:
        path = root / "bad.yaml"
        (path.write_bytes if isinstance(body, bytes) else path.write_text)(body)
        return path

    return make


def _big(root: Path) -> Path:
    path = root / "bad.yaml"
    with path.open("w") as out:  # valid YAML all the way: a 50 MB comment after a whole recipe
        out.write(BASE + "# " + "x" * (50 * 2**20) + "\n")
    return path


def _self_link(root: Path) -> Path:
    path = root / "bad.yaml"
    path.symlink_to("bad.yaml")
    return path


def _link_cycle(root: Path) -> Path:
    (root / "other.yaml").symlink_to("bad.yaml")
    (root / "bad.yaml").symlink_to("other.yaml")
    return root / "bad.yaml"


def _broken_link(root: Path) -> Path:
    (root / "bad.yaml").symlink_to("missing.yaml")
    return root / "bad.yaml"


def _directory(root: Path) -> Path:
    (root / "bad.yaml").mkdir()
    return root / "bad.yaml"


def _fifo(root: Path) -> Path:  # opening it for reading would block until a writer came
    os.mkfifo(root / "bad.yaml")
    return root / "bad.yaml"


def _device(root: Path) -> Path:  # /dev/zero would never end
    (root / "bad.yaml").symlink_to("/dev/zero")
    return root / "bad.yaml"


# (case, how to make the file, words the one-line error must contain)
YAML_CASES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("anchor containing itself (mapping)", _text(BASE + "x: &a {y: *a}\n"), "inside its own anchor &a"),
    ("anchor containing itself (sequence)", _text(BASE + "x: &a [1, *a]\n"), "inside its own anchor &a"),
    ("anchor containing itself (nested)", _text(BASE + "x: &a {y: [{z: *a}]}\n"), "inside its own anchor"),
    ("alias bomb of sequences", _text(BASE + _bomb("sequence")), "alias bomb"),
    ("alias bomb of mappings", _text(BASE + _bomb("mapping")), "alias bomb"),
    ("alias bomb through merge keys", _text(BASE + _bomb("mapping").replace("k0: *", "<<: *")), "alias bomb"),
    ("a 50 MB recipe", _big, "larger than 64 KiB"),
    ("a recipe just past 64 KiB", _text(BASE + "#" * (64 * 1024) + "\n"), "larger than 64 KiB"),
    ("a recipe symlinked to itself", _self_link, "cannot read: Too many levels of symbolic links"),
    ("a cycle of two symlinks", _link_cycle, "cannot read: Too many levels of symbolic links"),
    ("a broken symlink", _broken_link, "a broken symlink"),
    ("a directory named like a recipe", _directory, "a directory"),
    ("a FIFO", _fifo, "not a regular file"),
    ("a symlink to /dev/zero", _device, "not a regular file"),
    (
        "nested 5,000 levels deep (flow)",
        _text(BASE + "x: " + "[" * 5000 + "]" * 5000 + "\n"),
        "deeper than 16",
    ),
    (
        "nested 40 levels deep (block)",
        _text(BASE + "x:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 40)) + "  " * 40 + "v\n"),
        "deeper than 16",
    ),
    ("two documents", _text(BASE + "---\n" + BASE), "more than one YAML document"),
    ("an empty second document", _text(BASE + "---\n"), "more than one YAML document"),
    ("a list", _text("- model\n- training\n"), "expected a mapping of sections, got a list"),
    ("a scalar", _text("just some text\n"), "expected a mapping of sections, got text"),
    ("a number", _text("42\n"), "expected a mapping of sections, got a number"),
    ("empty", _text(""), "file is empty"),
    ("only a comment", _text("# nothing here\n"), "file is empty"),
    ("binary garbage", _text(bytes(range(256)) * 16), "not UTF-8 text"),
    ("NUL bytes in UTF-8", _text(BASE + "x: a\x00b\n"), "malformed YAML"),
    ("an undefined alias", _text(BASE + "x: *nowhere\n"), "malformed YAML"),
    ("a tab for indentation", _text(BASE + "x:\n\ty: 1\n"), "malformed YAML"),
    ("an unhashable key", _text(BASE + "? [a, b]\n: 1\n"), "malformed YAML"),
    ("a python object tag", _text(BASE + "x: !!python/object/apply:os.system [true]\n"), "malformed YAML"),
    ("a duplicate section", _text(BASE + "training: {steps: 5}\n"), "duplicate key 'training'"),
]


def _refused(call: Callable[[], Any]) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(TrainstackError) as caught:
        call()
    return str(caught.value), time.perf_counter() - start


@pytest.mark.parametrize(("case", "make", "words"), YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_a_bad_recipe_file_is_one_line_naming_it_well_under_a_second(tmp_path, case, make, words):
    path = make(tmp_path)
    message, seconds = _refused(lambda: resolve(str(path)))
    assert seconds < LOADER_LIMIT_S, f"{case}: {seconds:.2f} s"
    assert "\n" not in message and message.startswith(display_path(path) + ": "), message
    assert words in message, message


# --- every number of the schema, at and past its bounds --------------------------------------------


def _numeric_leaves() -> dict[str, tuple[type, float | None, bool, float | None]]:
    """Dotted path -> (int or float, lower bound, whether it is exclusive, upper bound) for every number."""
    out: dict[str, tuple[type, float | None, bool, float | None]] = {}

    def bounds(annotation: Any, metadata: list[Any]) -> tuple[type | None, float | None, bool, float | None]:
        kind, low, exclusive, high = None, None, False, None
        items = list(metadata)
        stack = [annotation]
        while stack:
            a = stack.pop()
            if typing.get_origin(a) is typing.Annotated:
                base, *meta = typing.get_args(a)
                stack.append(base)
                items += meta
            elif typing.get_origin(a) in (typing.Union, types.UnionType):
                stack += [x for x in typing.get_args(a) if x is not type(None)]
            elif a in (int, float):
                kind = a
        for item in items:
            for c in item.metadata if isinstance(item, FieldInfo) else [item]:
                if isinstance(c, Max) or isinstance(c, annotated_types.Le):
                    limit = c.limit if isinstance(c, Max) else c.le
                    high = limit if high is None else min(high, limit)
                lows = {Min: "limit", annotated_types.Gt: "gt", annotated_types.Ge: "ge"}
                for cls, attr in lows.items():
                    if isinstance(c, cls) and (low is None or getattr(c, attr) >= low):
                        strict = cls is annotated_types.Gt or (cls is Min and c.exclusive)
                        if low is None or getattr(c, attr) > low or strict:
                            low, exclusive = getattr(c, attr), strict
        return kind, low, exclusive, high

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            section = keys._section(info.annotation)
            if section is not None:
                walk(section, f"{prefix}{name}.")
                continue
            kind, low, exclusive, high = bounds(info.annotation, info.metadata)
            if kind is not None:
                out[f"{prefix}{name}"] = (kind, low, exclusive, high)

    walk(Recipe, "")
    return out


NUMBERS = _numeric_leaves()


def _bad_values(kind: type, low: float | None, exclusive: bool, high: float) -> list[tuple[str, Any]]:
    assert low is not None
    valid = high if kind is int else float(high)
    cases: list[tuple[str, Any]] = [
        ("past its maximum", int(high) + 1 if kind is int else high * 1.5),
        (
            "below its minimum",
            (int(low) if exclusive else int(low) - 1) if kind is int else low if exclusive else low - 1e-3,
        ),
        ("a number written as text", str(valid)),
        ("a boolean", True),
    ]
    if kind is int:
        cases += [("a huge integer", 10**30), ("a fraction", low + 1.5)]
    else:
        cases += [("infinite", math.inf), ("not a number", math.nan), ("-inf", -math.inf)]
    return cases


NUMBER_CASES = [
    (path, what, value)
    for path, (kind, low, exclusive, high) in NUMBERS.items()
    for what, value in _bad_values(kind, low, exclusive, high)
]


# Optional sections off in the shipped recipes, as a recipe that turns them on writes them: a field of
# theirs is tried inside an otherwise valid section.
SECTIONS_TURNED_ON = {
    "validation": {"every_steps": 1000, "batches": 10},
    "model.rope_scaling": {  # Llama 3.1's
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def _with(tree: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, leaf = path.split(".")
    out = yaml.safe_load(yaml.safe_dump(tree))
    node, dotted = out, ""
    for part in parents:
        dotted = f"{dotted}.{part}" if dotted else part
        if node.get(part) is None:
            node[part] = dict(SECTIONS_TURNED_ON.get(dotted, {}))
        node = node[part]
    node[leaf] = value
    return out


def test_every_number_in_the_schema_is_bounded_above_and_below():
    assert len(NUMBERS) >= 45  # the walk found the schema's numbers (47 when this was written)
    unbounded = [p for p, (_, low, _, high) in NUMBERS.items() if low is None or high is None or high > 1e15]
    assert unbounded == []


@pytest.mark.parametrize(
    ("field", "what", "value"), NUMBER_CASES, ids=[f"{c[0]}: {c[1]}" for c in NUMBER_CASES]
)
def test_a_number_out_of_bounds_names_the_file_and_field(tmp_path, field, what, value):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with(yaml.safe_load(BASE), field, value)))  # .inf, .nan, '20000', true
    message, _ = _refused(lambda: resolve(str(path)))
    assert "\n" not in message and message.startswith(f"{display_path(path)}: {field}: "), message


@pytest.mark.parametrize(
    ("assignment", "words"),
    [
        ("training.steps=1e20", "1e+20 is above 10,000,000"),
        ("training.steps=100000000000000000000", "is above 10,000,000"),
        ("training.lr=.inf", "expected a finite number, got inf"),
        ("training.lr='3e-4'", "got the text '3e-4'"),
        ("training.steps=yes", "got true (a boolean)"),
        ("training.steps=-0", "greater than 0"),
        ("compute.usd_per_instance_hour=.inf", "expected a finite number"),
        ("checkpointing.node_mtbf_hours=1e-300", "must be at least 24"),
        ("training.steps=&a [*a]", "inside its own anchor"),
        ("training.steps=" + _flow_bomb(), "alias bomb"),
    ],
)
def test_a_bad_set_value_names_the_override_and_field(recipes_dir, assignment, words):
    message, seconds = _refused(lambda: resolve("small", overrides=[assignment], recipes_dir=recipes_dir))
    assert seconds < LOADER_LIMIT_S
    field = assignment.split("=", 1)[0]
    assert message.startswith(f"--set {assignment}: {field}: ") and words in message, message


def test_numbers_that_are_fine_stay_fine(recipes_dir):
    recipe = resolve(
        "small",
        overrides=["training.lr=3e-4", "training.steps=2e4", "training.weight_decay=-0.0", "training.seed=0"],
        recipes_dir=recipes_dir,
    ).recipe
    assert (recipe.training.lr, recipe.training.steps, recipe.training.seed) == (3e-4, 20000, 0)
    assert math.copysign(1.0, recipe.training.weight_decay) == 1.0  # -0.0 read as 0.0


def test_a_run_of_more_than_100t_tokens_is_refused(recipes_dir):
    # 10M steps x 65,536 sequences x 8,192 tokens: each field within its own bound, the run not
    message, _ = _refused(
        lambda: resolve(
            "small",
            overrides=["training.steps=10000000", "training.global_batch=65536", "training.seq_len=8192"],
            recipes_dir=recipes_dir,
        )
    )
    assert "training.steps: steps x global_batch x seq_len = 5.37e+15 tokens is above 1e+14" in message


# --- the planner at every bound --------------------------------------------------------------------


def _edges(kind: type, low: float, exclusive: bool, high: float) -> list[float]:
    if kind is int:
        return [int(low) + (1 if exclusive else 0), int(high)]
    return [low * (1 + 1e-9) if exclusive and low else (1e-300 if exclusive else low), high]


def _floats(tree: Any, path: str = "") -> list[tuple[str, float]]:
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _floats(v, f"{path}.{k}")]
    if isinstance(tree, list | tuple):
        return [x for i, v in enumerate(tree) for x in _floats(v, f"{path}[{i}]")]
    return [(path, tree)] if isinstance(tree, float) else []


@pytest.mark.parametrize("base", ["30b-fp8", "8b-fp8-128k"])
def test_the_planner_gives_finite_figures_at_every_bound_of_every_field(base, capsys):
    """Property-style sweep: each numeric field at its least and greatest valid value, the rest of the
    recipe as shipped (4 nodes at 8K; 1 node at 128K). A recipe that validates plans to finite figures
    (or a one-line refusal, such as an interval shorter than a save), never an exception, inf or nan;
    `plan` prints the most extreme of them (cost, hours, storage) without inf or nan."""
    from trainstack.cli.commands.plan_options import print_plan
    from trainstack.planner import plan

    shipped = resolve(base).recipe.model_dump(mode="json", exclude={"extends"})
    plans, refused = [], 0
    for field, (kind, low, exclusive, high) in NUMBERS.items():
        for value in _edges(kind, low, exclusive, high):
            try:
                recipe = Recipe.model_validate(_with(shipped, field, value))
            except ValueError:
                continue  # refused by a cross-field check (e.g. a shard group the GPUs do not divide)
            try:
                result = plan(recipe)
            except TrainstackError:
                refused += 1
                continue
            bad = [(p, x) for p, x in _floats(result.to_dict()) if not math.isfinite(x)]
            assert bad == [], f"{field}={value}: {bad[:3]}"
            assert result.cost.total_usd < 1e10, f"{field}={value}: {result.cost.total_usd:.3g} USD"
            plans.append((f"{field}={value}", result))
    assert len(plans) > 60 and refused < 10, (len(plans), refused)
    figures = (
        lambda p: p.cost.total_usd,
        lambda p: p.cost.hours,
        lambda p: p.storage.tib_months,
        lambda p: p.run.jobs,
    )
    extremes = {
        id(p): (label, p)
        for f in figures
        for label, p in (min(plans, key=lambda lp: f(lp[1])), max(plans, key=lambda lp: f(lp[1])))
    }
    for label, result in extremes.values():
        print_plan(result, base, f"trainstack plan {base}")
        out = capsys.readouterr().out
        assert "inf" not in out.replace("info", "") and "nan" not in out, label


# --- team files: `recipes:` and bounds, in every command that reads them ---------------------------


@pytest.fixture
def team_tree(recipes_dir: Path) -> Path:
    (recipes_dir / "other.yaml").write_text("name: other\n" + SMALL)
    return recipes_dir


TEAM_DEFAULTS = [
    ("recipes: as text", "recipes: small\n", "recipes: must be a list of base recipe names"),
    ("recipes: an unknown recipe", "recipes: [small, smal]\n", "recipes: 'smal' is not a base recipe"),
    ("recipes: empty", "recipes: []\n", "recipes: must be a list of base recipe names"),
    ("recipes: numbers", "recipes: [1, 2]\n", "recipes: must be a list of base recipe names"),
    ("recipes: a mapping", "recipes: {small: true}\n", "recipes: must be a list of base recipe names"),
    ("an alias bomb", _bomb("mapping").replace("bomb:", "tags:\n  extra:\n    x:"), "alias bomb"),
    ("an anchor containing itself", "tags: &t {extra: *t}\n", "inside its own anchor"),
    ("an infinite price", "compute: {usd_per_instance_hour: .inf}\n", "compute.usd_per_instance_hour"),
]
COMMANDS = [
    ["plan", "small", "--team", "nlp"],
    ["show", "small", "--team", "nlp"],
    ["launch", "small", "--team", "nlp", "--dry-run"],
    ["validate"],
    ["recipes", "--team", "nlp"],
]


@pytest.mark.parametrize(("case", "text", "words"), TEAM_DEFAULTS, ids=[c[0] for c in TEAM_DEFAULTS])
def test_a_bad_team_defaults_file_is_refused_by_every_command(team_tree, case, text, words):
    defaults = team_tree / "teams" / "nlp" / "defaults.yaml"
    defaults.write_text(text)
    for command in COMMANDS:
        start = time.perf_counter()
        result = runner.invoke(app, [*command, "--recipes-dir", str(team_tree)])
        seconds = time.perf_counter() - start
        assert result.exit_code == 2 and seconds < 5 * LOADER_LIMIT_S, (command, seconds, result.output)
        assert "Traceback" not in result.output and not isinstance(result.exception, RecursionError)
        if command[0] == "recipes" and not words.startswith("recipes:"):
            continue  # a recipe the team's values break is a row of the table, with its error
        errors = [line for line in result.stderr.splitlines() if "defaults.yaml" in line]
        assert errors and all(words in line for line in errors), (command, result.stderr)
        if command[0] != "validate":  # validate prints one line per distinct error and a count
            assert len(result.stderr.strip().splitlines()) == 1, (command, result.stderr)


def test_the_cdk_apps_config_refuses_bad_recipes_and_team_files_in_one_line(team_tree):
    from trainstack.aws import deployment

    (team_tree / "teams" / "nlp" / "defaults.yaml").write_text("recipes: small\n")
    bomb = team_tree / "bomb.yaml"
    bomb.write_text(BASE.replace("name: bad", "name: bomb") + _bomb("sequence"))
    for context, words in (
        ({"recipe": "small", "team": "nlp"}, "recipes: must be a list"),
        ({"recipe": "all"}, "recipes: must be a list"),
        ({"recipe": str(bomb)}, "alias bomb"),
        (
            {"recipe": "small", "set": "training.lr=.inf"},
            "-c set=training.lr=.inf: training.lr: expected a finite",
        ),
    ):
        message, seconds = _refused(lambda c=context: deployment.load(c, {}, recipes_dir=str(team_tree)))
        assert seconds < 5 * LOADER_LIMIT_S and "\n" not in message and words in message, (context, message)


def test_shell_completion_stays_quick_and_quiet_on_a_hostile_team_tree(team_tree):
    from trainstack.cli import completion

    (team_tree / "teams" / "nlp" / "defaults.yaml").write_text("recipes: [small]\n" + _bomb("mapping"))
    (team_tree / "teams" / "loop").mkdir()
    (team_tree / "teams" / "loop" / "defaults.yaml").symlink_to("defaults.yaml")
    ctx = types.SimpleNamespace(params={"recipes_dir": str(team_tree), "team": "nlp"})
    start = time.perf_counter()
    names = completion.recipe_names(ctx, None, "")
    teams = completion.team_names(ctx, None, "")
    assert time.perf_counter() - start < 5 * LOADER_LIMIT_S
    assert names == [] and teams == ["loop", "nlp"]  # the bomb is refused, so nothing is offered


def test_diff_refuses_a_bad_recipe_in_the_working_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "recipes" / "teams").mkdir(parents=True)
    (repo / "recipes" / "small.yaml").write_text("name: small\n" + SMALL)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "recipes"], check=True)
    (repo / "recipes" / "small.yaml").write_text("name: small\n" + SMALL + _bomb("sequence"))
    start = time.perf_counter()
    result = runner.invoke(app, ["diff", "--base", "HEAD", "--no-synth", "--repo", str(repo)])
    assert time.perf_counter() - start < 10 * LOADER_LIMIT_S
    assert "alias bomb" in result.output and "Traceback" not in result.output, result.output


# --- the installed console script, as a person runs it ----------------------------------------------


@pytest.mark.parametrize(
    ("case", "make", "command"),
    [
        ("alias bomb", _text(BASE + _bomb("mapping")), "plan"),
        ("50 MB", _big, "validate"),
        ("symlinked to itself", _self_link, "plan"),
    ],
)
def test_the_console_script_answers_in_one_line_within_seconds(tmp_path, case, make, command):
    path = make(tmp_path)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainstack.cli.main", command, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.perf_counter() - start
    assert proc.returncode == 2 and seconds < PROCESS_LIMIT_S, (seconds, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if str(path.name) in line]
    assert len(errors) == 1, proc.stderr
