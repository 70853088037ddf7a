"""Blends, validation and the input mode outside the trainer: the recipe fields, the metric line and its
MetricDefinitions, the planner's validation time, the launcher's input mode and its request."""

from __future__ import annotations

import json
import re

import pytest

from trainstack.aws.request import create_training_job_request, hyperparameter_overrides
from trainstack.aws.request_check import PLACEHOLDERS, check_recipe, check_request, longest_job_name
from trainstack.errors import RecipeError
from trainstack.planner import plan
from trainstack.planner.input_mode import FILE_MODE_MAX_GB, input_plan
from trainstack.planner.validation import forward_flops_per_token
from trainstack.protocol.metrics import (
    FIELDS,
    format_line,
    format_validation_line,
    metric_definitions,
    parse_line,
)
from trainstack.recipes import changes
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import MAX_SOURCES, from_hyperparameters, to_hyperparameters

pytestmark = pytest.mark.fast

TRAINING = dict(
    step=40,
    loss=2.5,
    lr=3e-4,
    tokens_per_sec=1000.0,
    tflops_per_gpu=100.0,
    mfu=0.3,
    mem_gib=100.0,
    step_time_s=2.0,
    straggler_host=1,
    straggler_rank=3,
    straggler_compute_s=0.5,
    straggler_skew=0.01,
)


def sources(*items: tuple[str, float, float | None]) -> str:
    return "data.sources=" + json.dumps([{"uri": u, "weight": w, "size_gb": g} for u, w, g in items])


def blend(*extra: str, name: str = "30b-fp8"):
    return resolve(
        name,
        overrides=[
            sources(("s3://corpus/tok/web-2024/", 0.7, 30.0), ("s3://corpus/tok/code/", 0.3, 10.0)),
            *extra,
        ],
    ).recipe


# --- the recipe ----------------------------------------------------------------------------------


def test_sources_are_named_from_their_uri_and_refused_in_one_line_when_wrong():
    r = blend()
    assert r.data.source_names == ("web_2024", "code")
    assert [s.channel for s in r.data.sources] == ["train_web_2024", "train_code"]
    assert r.data.uris == ("s3://corpus/tok/web-2024/", "s3://corpus/tok/code/")
    one = sources(("s3://corpus/web/", 1, None))
    bad = {
        (
            one,
            "data.train_s3_uri=s3://corpus/one/",
        ): "data.sources: set train_s3_uri (one dataset) or sources",
        (
            sources(("s3://corpus-a/x/", 1, None), ("s3://corpus-b/x/", 1, None)),
        ): "data.sources: source 1 is named 'x' like source 0",
        (sources(*[(f"s3://corpus/s{i}/", 1, None) for i in range(MAX_SOURCES + 1)]),): "at most 16",
        (sources(("s3://corpus/web/", 0, None)),): "data.sources.0.weight",
        (one, "data.size_gb=10"): "data.size_gb: applies to train_s3_uri only",
    }
    for overrides, message in bad.items():
        with pytest.raises(RecipeError) as error:
            resolve("30b-fp8", overrides=list(overrides))
        assert message in str(error.value), str(error.value)


def test_blend_and_validation_travel_as_hyperparameters_and_a_later_override_can_add_validation():
    r = blend("validation.every_steps=500", "validation.batches=4")
    assert from_hyperparameters(to_hyperparameters(r)) == r
    plain = resolve("30b-fp8").recipe
    encoded = to_hyperparameters(plain)
    assert encoded["validation"] == "null"
    with_validation = resolve(
        "30b-fp8", overrides=["validation.every_steps=100", "validation.batches=2"]
    ).recipe
    # What a resume --set sends: the launch's hyperparameters merged with the overrides (Step Functions'
    # States.JsonMerge), so the stale "validation": "null" stays beside the new keys.
    merged = {**encoded, **hyperparameter_overrides(plain, with_validation)}
    assert from_hyperparameters(merged).validation == with_validation.validation
    found = changes.changes(plain, with_validation)
    assert found and not changes.unsafe(found)  # adding validation mid-run is safe
    before, after = (
        blend(),
        resolve(
            "30b-fp8",
            overrides=[
                sources(("s3://corpus/tok/web-2024/", 0.5, 30.0), ("s3://corpus/tok/code/", 0.5, 10.0))
            ],
        ).recipe,
    )
    assert [c.key for c in changes.changes(before, after)] == [
        "data.sources.0.weight",
        "data.sources.1.weight",
    ]
    assert not changes.unsafe(changes.changes(before, after))


# --- the metric line -----------------------------------------------------------------------------


def test_validation_fields_parse_only_on_validation_lines_and_never_inside_each_other():
    names = ("web", "code")
    plain = format_line(names, **TRAINING)
    assert "val_loss" not in plain and parse_line(plain, names) == pytest.approx(TRAINING)
    line = format_line(names, **TRAINING, val_loss=2.75, val_loss_web=2.5, val_loss_code=3.0)
    assert line.endswith(" val_loss=2.75 val_loss_web=2.5 val_loss_code=3")
    parsed = parse_line(line, names)
    assert (parsed["loss"], parsed["val_loss"], parsed["val_loss_web"]) == (2.5, 2.75, 2.5)
    definitions = metric_definitions(names)
    regex = {d["Name"]: d["Regex"] for d in definitions}
    assert re.findall(regex["train:val_loss"], line) == ["2.75"]
    assert re.findall(regex["train:loss"], line) == ["2.5"]
    with pytest.raises(ValueError, match="unknown"):
        format_line(("web",), **TRAINING, val_loss_code=1.0)


def test_the_step_0_validation_line_reads_as_val_loss_at_step_0_with_no_training_values():
    line = format_validation_line(0, ("web", "code"), val_loss=10.5, val_loss_web=10.25, val_loss_code=10.75)
    assert line == "step=0 val_loss=10.5 val_loss_web=10.25 val_loss_code=10.75"
    regex = {d["Name"]: d["Regex"] for d in metric_definitions(("web", "code"))}
    assert re.findall(regex["train:step"], line) == ["0"] and re.findall(regex["train:val_loss"], line) == [
        "10.5"
    ]
    assert re.findall(regex["train:loss"], line) == []  # never read inside val_loss=
    with pytest.raises(ValueError, match="unknown"):
        format_validation_line(0, (), val_loss=1.0, loss=2.0)  # a training value has no place at step 0


def test_validation_at_start_is_on_with_a_base_model_off_without_and_as_set_otherwise():
    def at_start(*overrides: str) -> bool:
        return resolve(
            "1b-bf16", overrides=["validation.every_steps=100", "validation.batches=1", *overrides]
        ).recipe.validates_at_start

    assert not at_start()
    assert at_start("model.init_from=s3://base/llama/")
    assert not at_start("model.init_from=s3://base/llama/", "validation.at_start=false")
    assert at_start("validation.at_start=true")
    assert not resolve("1b-bf16", overrides=["model.init_from=s3://base/llama/"]).recipe.validates_at_start
    # the planner counts the extra evaluation
    with_base = resolve(
        "1b-bf16",
        overrides=["validation.every_steps=100", "validation.batches=1", "model.init_from=s3://base/llama/"],
    ).recipe
    plain = resolve("1b-bf16", overrides=["validation.every_steps=100", "validation.batches=1"]).recipe
    assert plan(with_base).validation.evaluations == plan(plain).validation.evaluations + 1


def test_the_largest_blend_stays_within_createtrainingjobs_40_metric_definitions():
    """MetricDefinitions: at most 40, names 1-255 and regexes 1-500 characters (SageMaker API reference,
    CreateTrainingJob); a 16-source blend with the longest names is checked against botocore's model."""
    names = tuple(f"s{i:02d}" + "x" * 12 for i in range(MAX_SOURCES))
    definitions = metric_definitions(names)
    assert len(definitions) == len(FIELDS) + MAX_SOURCES + 1 <= 40  # + train:saved_step
    assert all(1 <= len(d["Name"]) <= 255 and 1 <= len(d["Regex"]) <= 500 for d in definitions)


# --- the planner's validation time ----------------------------------------------------------------


def test_validation_time_is_the_forward_flops_of_its_batches_at_the_planned_rate_in_hours_and_cost():
    base = resolve("8b-fp8").recipe
    r = resolve("8b-fp8", overrides=["validation.every_steps=250", "validation.batches=8"]).recipe
    without, with_validation = plan(base), plan(r)
    v, thr, m, tr = with_validation.validation, with_validation.throughput, r.model, r.training
    # By hand: forward FLOPs = 2 x (block and head weights) + 4 x L x H x Q x T per token.
    forward = (
        2 * (m.non_embedding_params + m.vocab * m.hidden) + 4 * m.layers * m.heads * m.head_dim * tr.seq_len
    )
    assert forward_flops_per_token(m, tr.seq_len) == pytest.approx(forward)
    tokens = 8 * tr.global_batch * tr.seq_len
    seconds = tokens * forward / (thr.achieved_tflops_per_gpu * 1e12 * r.world_size)
    assert v.seconds_per_evaluation == pytest.approx(seconds)
    assert v.evaluations == tr.steps // 250 and v.hours == pytest.approx(v.evaluations * seconds / 3600)
    # about a third of a training step per batch of global_batch (no backward, no recompute)
    assert seconds / 8 < thr.step_time_s / 2.5
    assert with_validation.run.hours == without.run.hours  # training itself is unchanged
    assert with_validation.cost.hours == pytest.approx(without.cost.hours + v.hours)
    assert with_validation.cost.total_usd > without.cost.total_usd
    low, high = with_validation.cost.hours_range
    assert low < with_validation.cost.hours < high
    # A blend validates every source: one split each.
    two = plan(blend("validation.every_steps=250", "validation.batches=8", name="8b-fp8")).validation
    assert two.splits == 2 and two.seconds_per_evaluation == pytest.approx(2 * seconds)


# --- the input mode -------------------------------------------------------------------------------


def test_input_mode_follows_the_size_the_recipe_gives():
    def mode(*overrides: str) -> str:
        return input_plan(resolve("8b-fp8", overrides=list(overrides)).recipe).mode

    assert mode() == ""  # synthetic: no channel
    uri = "data.train_s3_uri=s3://corpus/tokens/"
    assert mode(uri) == "FastFile"  # size unknown
    assert mode(uri, f"data.size_gb={FILE_MODE_MAX_GB}") == "File"
    assert mode(uri, f"data.size_gb={FILE_MODE_MAX_GB + 1}") == "FastFile"
    assert mode(uri, "data.size_gb=5000", "data.input_mode=File") == "File"  # the recipe's say wins
    small_blend = blend(name="8b-fp8")  # 30 + 10 GB: copied
    assert input_plan(small_blend).mode == "File"
    assert "40.0 GB <= 50 GB" in input_plan(small_blend).reason
    big = resolve(
        "8b-fp8", overrides=[sources(("s3://corpus/web/", 1, 900.0), ("s3://corpus/code/", 1, None))]
    ).recipe
    assert input_plan(big).mode == "FastFile" and "size unknown" in input_plan(big).reason
    huge = input_plan(resolve("8b-fp8", overrides=[uri, "data.size_gb=40000"]).recipe)
    assert huge.mode == "FastFile" and "FSx for Lustre" in huge.reason


def test_the_request_carries_one_channel_per_source_in_the_chosen_mode_and_sagemaker_accepts_it():
    r = blend()
    request = create_training_job_request(r, None, job_name=longest_job_name(r, None), **PLACEHOLDERS)
    assert check_request(request) == []
    # 30b-fp8 continues from a base model: its own channel (docs/models.md) comes after the data's
    channels = [c for c in request["InputDataConfig"] if c["ChannelName"] != "base"]
    assert [c["ChannelName"] for c in channels] == ["train_web_2024", "train_code"]
    assert (
        {c["InputMode"] for c in channels}
        == {"File"}
        == {request["AlgorithmSpecification"]["TrainingInputMode"]}
    )
    assert [c["DataSource"]["S3DataSource"]["S3Uri"] for c in channels] == list(r.data.uris)
    names = [d["Name"] for d in request["AlgorithmSpecification"]["MetricDefinitions"]]
    assert names[-4:] == [
        "train:val_loss",
        "train:val_loss_web_2024",
        "train:val_loss_code",
        "train:saved_step",
    ]
    # CreateTrainingJob takes at most 20 channels (botocore's model): the schema caps sources below it.
    many = resolve(
        "30b-fp8",
        overrides=[sources(*[(f"s3://corpus/tokenized/source-{i:02d}/", 1, None) for i in range(16)])],
    ).recipe
    assert check_recipe(many, None) == []
    too_long = resolve(
        "30b-fp8", overrides=[sources(*[(f"s3://corpus/{'p' * 150}/s{i:02d}/", 1, None) for i in range(16)])]
    ).recipe
    (finding,) = {f.field for f in check_recipe(too_long, None)}
    assert finding == "data.sources"  # the encoded blend is over SageMaker's 2,500 characters per value


def test_plan_and_dry_run_say_which_input_mode_and_why(recipes_dir):
    from typer.testing import CliRunner

    from trainstack.cli.main import app

    runner = CliRunner()
    data = ["--set", "data.train_s3_uri=s3://corpus/tokens/", "--set", "data.size_gb=20"]
    validation = ["--set", "validation.every_steps=500", "--set", "validation.batches=4"]
    shown = runner.invoke(app, ["plan", "8b-fp8", *data, *validation], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    rows: dict[str, str] = {}  # the plan's table: what -> value (wrapped cells joined)
    key = ""
    for line in shown.output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 2:
            key = cells[0] or key
            rows[key] = (rows.get(key, "") + " " + cells[1]).strip()
    assert rows["data input"].startswith("File (1 channel): 20.0 GB <= 50 GB: copied to every node")
    assert rows["validation"].startswith("every 500 steps: 4 batches x 1 split")
    no_aws = {"AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null", "AWS_PROFILE": None,
              "AWS_REGION": None, "AWS_DEFAULT_REGION": None, "AWS_ENDPOINT_URL": None,
              "AWS_EC2_METADATA_DISABLED": "true", "AWS_ACCESS_KEY_ID": None}  # fmt: skip
    small = recipes_dir / "small.yaml"
    small.write_text(small.read_text() + "data: {train_s3_uri: s3://corpus/tokens/, size_gb: 20}\n")
    dry = runner.invoke(
        app, ["launch", "small", "--recipes-dir", str(recipes_dir), "--dry-run", "--json"], env=no_aws
    )
    assert dry.exit_code == 0, dry.output
    assert "data input: File (1 channel): 20.0 GB <= 50 GB" in dry.stderr
    printed = json.loads(dry.stdout)
    assert printed["input"]["mode"] == "File" == printed["request"]["InputDataConfig"][0]["InputMode"]
