"""Every kind of bad input the issue lists: one line on stderr naming the file and the field path,
exit status 2, no traceback, for `plan` and for the `validate` gate."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app

pytestmark = pytest.mark.fast


def variant(replace: str = "", by: str = "", extra: str = "") -> tuple[str, str, str]:
    """An edit of the valid `small` recipe (conftest.SMALL): replace one text, append another."""
    return (replace, by, extra)


# (case id, file name, file text, field path the error must name, words the message must contain)
BAD_FILES = [
    ("unknown key", "bad.yaml", variant(extra="optimiser: adamw\n"), "optimiser", "unknown key"),
    ("unknown nested key", "bad.yaml", variant("ffn: 128", "ffn: 128, fnn: 3"), "model.fnn", "unknown key"),
    ("wrong type", "bad.yaml", variant("layers: 2", "layers: two"), "model.layers", "integer"),
    ("negative size", "bad.yaml", variant("hidden: 64", "hidden: -64"), "model.hidden", "greater than 0"),
    (
        "zero size",
        "bad.yaml",
        variant("micro_batch: 1", "micro_batch: 0"),
        "training.micro_batch",
        "greater than 0",
    ),
    (
        "heads not divisible by kv_heads",
        "bad.yaml",
        variant("kv_heads: 2", "kv_heads: 3"),
        "model.kv_heads",
        "divisible",
    ),
    (
        "hidden not divisible by heads",
        "bad.yaml",
        variant("heads: 4,", "heads: 5,"),
        "model.hidden",
        "divisible",
    ),
    (
        "tensor parallelism, which the trainer does not implement",
        "bad.yaml",
        variant("shard_group: 8", "shard_group: 4, tp: 2"),
        "parallelism.tp",
        "the trainer does not implement tensor parallelism",
    ),
    (
        "a sequence that context parallelism cannot cut into 2 x cp equal chunks",
        "bad.yaml",
        variant(
            "seq_len: 32, micro_batch: 1, global_batch: 8, steps: 10}\nprecision: {dtype: bf16}\n"
            "activation_checkpointing: {mode: none}\nparallelism: {shard_group: 8}",
            "seq_len: 36, micro_batch: 1, global_batch: 8, steps: 10}\nprecision: {dtype: bf16}\n"
            "activation_checkpointing: {mode: none}\nparallelism: {shard_group: 1, cp: 8}",
        ),
        "parallelism.cp",
        "not divisible by 2 x cp = 16",
    ),
    (
        "gpus not divisible by shard_group x tp x cp",
        "bad.yaml",
        variant("shard_group: 8", "shard_group: 3"),
        "parallelism.shard_group",
        "not divisible",
    ),
    (
        "FP8 with the op-level checkpointing policy, which the trainer cannot run",
        "bad.yaml",
        variant(
            "precision: {dtype: bf16}\nactivation_checkpointing: {mode: none}",
            "precision: {dtype: fp8, fp8_recipe: mxfp8}\n"
            "activation_checkpointing: {mode: selective, policy: op}",
        ),
        "activation_checkpointing.policy",
        "op cannot run with precision.dtype fp8",
    ),
    (
        "unknown instance type",
        "bad.yaml",
        variant("ml.p6-b200.48xlarge", "ml.p4d.24xlarge"),
        "compute.instance_type",
        "not offered",
    ),
    (
        "missing extends",
        "bad.yaml",
        "extends: nonexistent\n",
        "extends",
        "no base recipe named 'nonexistent'",
    ),
    ("malformed yaml", "bad.yaml", "model: {layers: 2\n  hidden: [\n", None, "malformed YAML at line"),
    ("empty file", "bad.yaml", "", None, "file is empty"),
    (
        "duplicate section",
        "bad.yaml",
        variant(extra="training: {steps: 5}\n"),
        None,
        "malformed YAML at line 7, column 1: duplicate key 'training'",
    ),
]


def file_text(text: str | tuple[str, str, str], small: str) -> str:
    if isinstance(text, str):
        return text
    replace, by, extra = text
    assert replace in small
    return small.replace(replace, by, 1) + extra


def assert_one_line_error(result, file_name: str, field: str | None, words: str) -> None:
    assert result.exit_code == 2, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.exception
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    line = lines[0]
    assert file_name in line
    if field is not None:
        assert f": {field}: " in line
    assert words in line


@pytest.mark.parametrize("case, name, text, field, words", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_plan_rejects_bad_recipe_file(recipes_dir, small_text, case, name, text, field, words):
    path = recipes_dir.parent / name
    path.write_text(file_text(text, small_text))
    result = CliRunner().invoke(app, ["plan", str(path), "--recipes-dir", str(recipes_dir)])
    assert_one_line_error(result, name, field, words)


@pytest.mark.parametrize("case, name, text, field, words", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_validate_rejects_bad_base_recipe(recipes_dir, small_text, case, name, text, field, words):
    path = recipes_dir / name
    path.write_text(file_text(text, small_text))
    result = CliRunner().invoke(app, ["validate", "--quiet", "--recipes-dir", str(recipes_dir)])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("invalid ")]
    assert len(errors) == 1, result.stderr
    assert name in errors[0] and words in errors[0]
    if field is not None:
        assert f": {field}: " in errors[0]


def test_cyclic_extends(recipes_dir):
    (recipes_dir / "a.yaml").write_text("name: a\nextends: b\n")
    (recipes_dir / "b.yaml").write_text("name: b\nextends: a\n")
    result = CliRunner().invoke(app, ["plan", "a", "--recipes-dir", str(recipes_dir)])
    assert_one_line_error(result, "a.yaml", "extends", "cyclic extends")
    assert "b.yaml" in result.stderr


def test_unknown_team(recipes_dir):
    result = CliRunner().invoke(app, ["plan", "small", "--team", "nope", "--recipes-dir", str(recipes_dir)])
    assert_one_line_error(result, "teams", "team", "unknown team 'nope' (known: nlp)")


def test_unknown_recipe_name(recipes_dir):
    result = CliRunner().invoke(app, ["plan", "huge", "--recipes-dir", str(recipes_dir)])
    assert_one_line_error(result, str(recipes_dir.name), "recipe", "unknown recipe 'huge' (known: small)")


def test_bad_value_in_a_team_file_names_the_team_file(recipes_dir):
    team_file = recipes_dir / "teams" / "nlp" / "small.yaml"
    team_file.write_text("parallelism: {shard_group: 3}\n")
    result = CliRunner().invoke(app, ["plan", "small", "--team", "nlp", "--recipes-dir", str(recipes_dir)])
    assert_one_line_error(result, "teams/nlp/small.yaml", "parallelism.shard_group", "not divisible")
    gate = CliRunner().invoke(app, ["validate", str(team_file)])
    assert gate.exit_code == 2 and "teams/nlp/small.yaml: parallelism.shard_group" in gate.stderr


def test_team_defaults_are_validated_against_every_recipe(recipes_dir):
    (recipes_dir / "teams" / "nlp" / "defaults.yaml").write_text("monitoring: {notification_email: nope}\n")
    result = CliRunner().invoke(app, ["validate", str(recipes_dir / "teams" / "nlp" / "defaults.yaml")])
    assert result.exit_code == 2
    assert (
        "defaults.yaml: monitoring.notification_email: 'nope' is not an e-mail address, e.g. ml-alerts@"
        in result.stderr
    )


def test_bad_set_override_names_set_and_the_field(recipes_dir):
    result = CliRunner().invoke(
        app, ["plan", "small", "--set", "training.micro_batch=-1", "--recipes-dir", str(recipes_dir)]
    )
    assert_one_line_error(result, "--set", "training.micro_batch", "greater than 0")


def test_fp8_set_on_an_op_policy_recipe_is_refused_before_any_plan(recipes_dir, small_text):
    # A BF16 recipe with policy op, made FP8 by an override: refused by the schema (exit 2, one line
    # naming the overrides that made it so), not at job start after the nodes are paid for.
    (recipes_dir / "opsmall.yaml").write_text(
        "name: opsmall\n" + small_text.replace("{mode: none}", "{mode: selective, policy: op}")
    )
    ok = CliRunner().invoke(app, ["plan", "opsmall", "--recipes-dir", str(recipes_dir)])
    assert ok.exit_code == 0, ok.output
    sets = ["--set", "precision.dtype=fp8", "--set", "precision.fp8_recipe=mxfp8"]
    result = CliRunner().invoke(app, ["plan", "opsmall", *sets, "--recipes-dir", str(recipes_dir)])
    assert_one_line_error(
        result,
        "--set precision.dtype=fp8, --set precision.fp8_recipe=mxfp8",
        "activation_checkpointing.policy",
        "use mode full",
    )


def test_console_script_prints_one_line_and_exits_2(tmp_path):
    """The installed entry point (trainstack.cli.main:main), not only pytest, stays traceback-free."""
    bad = tmp_path / "empty.yaml"
    bad.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "trainstack.cli.main", "plan", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "empty.yaml: file is empty" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# --- the CLI's shared error path (trainstack.cli.main._Commands): usage, files, AWS ------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["plan"], "Missing argument 'recipe' (see `trainstack plan -h`)"),
        (["plan", "small", "--bogus"], "No such option: --bogus (see `trainstack plan -h`)"),
        (["--bogus"], "No such option: --bogus (see `trainstack -h`)"),
        (["plann"], "No such command 'plann'"),
        (["status", "small", "--interval", "0"], "Invalid value for '--interval'"),
        (["launch", "small", "--max-steps", "many"], "Invalid value for '--max-steps'"),
    ],
    ids=[
        "missing argument",
        "unknown option",
        "unknown root option",
        "unknown command",
        "out of range",
        "type",
    ],
)
def test_usage_mistakes_are_one_line(args, words):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr


def test_no_arguments_still_prints_help():
    result = CliRunner().invoke(app, [])
    assert "Usage: trainstack" in result.stdout and "Commands" in result.stdout and result.stderr == ""


def test_missing_recipes_dir_is_refused_not_an_empty_pass(tmp_path):
    """A mistyped --recipes-dir (or TRAINSTACK_RECIPES_DIR) must not let the validate gate pass on nothing."""
    missing = tmp_path / "recipe"
    for command in (["validate"], ["recipes"], ["plan", "small"]):
        result = CliRunner().invoke(app, [*command, "--recipes-dir", str(missing)])
        assert result.exit_code == 2, command
        assert f"'{missing}' does not exist" in result.stderr and result.stdout == "", command
    result = CliRunner().invoke(app, ["validate"], env={"TRAINSTACK_RECIPES_DIR": str(missing)})
    assert result.exit_code == 2 and "TRAINSTACK_RECIPES_DIR" in result.stderr


def test_validate_names_a_missing_path_and_counts_it(tmp_path):
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"invalid {tmp_path / 'nope.yaml'}: no such file or directory",
        "0 valid, 1 invalid",
    ]


def test_unwritable_output_file_is_one_line_and_nothing_written(tmp_path, recipes_dir):
    target = tmp_path / "no-such-dir" / "schema.json"
    result = CliRunner().invoke(app, ["schema", "-o", str(target)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {target}: No such file or directory"
    assert not target.parent.exists()


def test_an_aws_error_a_command_did_not_handle_is_one_explained_line(monkeypatch, recipes_dir):
    """Any botocore error reaching the CLI (here: a named AWS profile that does not exist) is one line."""
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(recipes_dir / "absent-config"))
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    result = CliRunner().invoke(app, ["launch", "small", "--recipes-dir", str(recipes_dir)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-profile" in lines[0] and "fix or unset it" in lines[0], result.stderr


def test_a_binary_file_is_one_line_not_a_decode_traceback(recipes_dir):
    path = recipes_dir.parent / "binary.yaml"
    path.write_bytes(b"name: x\n\xff\xfe\x00")
    result = CliRunner().invoke(app, ["plan", str(path), "--recipes-dir", str(recipes_dir)])
    assert_one_line_error(result, "binary.yaml", None, "not UTF-8 text (byte 8)")


def test_a_team_file_given_as_a_recipe_says_how_to_use_it(recipes_dir):
    team_file = recipes_dir / "teams" / "nlp" / "small.yaml"
    team_file.write_text("training: {steps: 5}\n")
    result = CliRunner().invoke(app, ["show", str(team_file), "--recipes-dir", str(recipes_dir)])
    assert_one_line_error(result, "teams/nlp/small.yaml", None, "use `small --team nlp`")


@pytest.mark.parametrize(
    "args, words",
    [
        (["status", "small", "--json", "--watch"], "--json prints one snapshot and cannot --watch"),
        (["diff", "--json", "--markdown"], "--json and --markdown are two formats of one output"),
    ],
)
def test_options_that_exclude_each_other_are_refused(recipes_dir, args, words):
    extra = ["--recipes-dir", str(recipes_dir)] if args[0] == "status" else []
    result = CliRunner().invoke(app, [*args, *extra])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {words}"), result.stderr


def test_the_emulator_record_is_found_in_the_nearest_directory_above(tmp_path, monkeypatch):
    from trainstack.emulator.endpoint import STATE_FILE, state_file

    (tmp_path / STATE_FILE).parent.mkdir()
    (tmp_path / STATE_FILE).write_text("{}")
    below = tmp_path / "a" / "b"
    below.mkdir(parents=True)
    assert state_file(below) == tmp_path.resolve() / STATE_FILE
    assert state_file(tmp_path) == tmp_path.resolve() / STATE_FILE
    monkeypatch.chdir(below)
    assert state_file() == tmp_path.resolve() / STATE_FILE
    (below / STATE_FILE).parent.mkdir()
    (below / STATE_FILE).write_text("{}")
    assert state_file() == below.resolve() / STATE_FILE  # the nearest wins
