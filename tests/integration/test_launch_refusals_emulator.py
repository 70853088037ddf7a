"""What `launch` and `plan` refuse before anything is paid, against the emulator's S3 (issue 40 items 4, 6):
a base model (`model.init_from`, an s3:// prefix) whose config.json differs from the recipe, or that is
not there, is refused in one line naming the field and both values, and no training job exists; a
refused launch of a recipe given by path suggests a deploy command that can deploy it."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

BUCKET = "bases"


@pytest.fixture(scope="module")
def emulator():
    from trainstack.emulator.endpoint import Emulator

    with Emulator(jobs="hold") as running:
        s3 = running.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=176, vocab_size=256,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        ).to_dict()  # fmt: skip
        s3.put_object(Bucket=BUCKET, Key="llama-small/config.json", Body=json.dumps(config).encode())
        yield running


def cli(running, *args: str, local: bool = True):
    """The command with the emulator's AWS_* variables (as `eval "$(trainstack emulator env)"` sets them)."""
    env = {**running.env(), "COLUMNS": "200", "NO_COLOR": "1"}
    return CliRunner(env=env).invoke(app, [*args, *(["--local"] if local else [])])


def recipe_file(tmp_path, init_from: str, tied: bool) -> str:
    """A continued-pretraining recipe over the tied 1b-bf16, with the small Llama's shape."""
    path = tmp_path / "cpt-small.yaml"
    path.write_text(
        "name: cpt-small\nextends: 1b-bf16\n"
        f"model: {{layers: 2, hidden: 64, heads: 4, kv_heads: 2, ffn: 176, vocab: 256, rope_theta: 10000.0, "
        f"norm_eps: 1.0e-6, tied_embeddings: {'true' if tied else 'false'}, init_from: {init_from}}}\n"
        "training: {seq_len: 64, micro_batch: 1, global_batch: 8, steps: 10}\n"
    )
    return str(path)


def no_jobs(running) -> bool:
    return running.client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []


def test_launch_and_plan_refuse_a_base_whose_config_differs_before_any_job(emulator, tmp_path):
    recipe = recipe_file(tmp_path, f"s3://{BUCKET}/llama-small/", tied=True)
    line = (
        f"error: model.init_from: s3://{BUCKET}/llama-small/config.json: tie_word_embeddings is false, "
        "the recipe's model.tied_embeddings is true"
    )
    launched = cli(emulator, "launch", recipe)
    assert launched.exit_code == 2, launched.output
    assert launched.output.startswith(line) and len(launched.output.strip().splitlines()) == 1
    planned = cli(emulator, "plan", recipe, "-q", local=False)  # boto3 finds the emulator's endpoint
    assert planned.exit_code == 2 and planned.output.strip().splitlines()[-1].startswith(line)
    assert no_jobs(emulator)


def test_launch_refuses_a_base_prefix_without_config_json(emulator, tmp_path):
    recipe = recipe_file(tmp_path, f"s3://{BUCKET}/nothing-here/", tied=False)
    launched = cli(emulator, "launch", recipe)
    assert launched.exit_code == 2
    assert launched.output.startswith(
        f"error: model.init_from: s3://{BUCKET}/nothing-here/config.json: no such object"
    )
    assert no_jobs(emulator)


def test_a_refused_launch_of_a_recipe_file_suggests_a_deploy_that_resolves_that_file(emulator, tmp_path):
    """The matching base passes the check; the stacks are not deployed, so launch says how to deploy
    them, and the `-c recipe=` it names is one the CDK app's context loader resolves to this recipe."""
    from trainstack.aws.deployment import load

    recipe = recipe_file(tmp_path, f"s3://{BUCKET}/llama-small/", tied=False)
    launched = cli(emulator, "launch", recipe)
    assert launched.exit_code == 2, launched.output
    found = re.search(r"-c recipe=([^\s`]+)", launched.output)  # the hint is quoted in backticks
    assert found, launched.output
    context_recipe = shlex.split(found.group(1))[0]
    assert context_recipe != "cpt-small"  # a name the CDK app cannot find (it reads recipes/)
    config = load({"recipe": context_recipe, "emulator": "true"}, {}, base_image_resolver=lambda *a: "img")
    assert config.deployments[0].recipe.name == "cpt-small"
    assert no_jobs(emulator)


def test_a_base_the_job_cannot_reach_is_noted_by_plan_and_skipped_for_the_emulators_stand_in(
    emulator, tmp_path
):
    """plan needs no AWS: a base it cannot read is one note on stderr, the plan stands. On the emulator
    30b-fp8 trains as a stand-in from random weights (its base, in a bucket only a README names, is never
    read): launch --local does not refuse it for that base, and goes on to say what is missing."""
    recipe = recipe_file(tmp_path, "s3://no-such-bucket/llama/", tied=False)
    planned = cli(emulator, "plan", recipe, "-q", local=False)
    assert planned.exit_code == 0, planned.output
    assert (
        "note: model.init_from: s3://no-such-bucket/llama/config.json: bucket no-such-bucket does not exist"
        in (planned.output)
    )
    launched = cli(emulator, "launch", "30b-fp8")
    assert launched.exit_code == 2
    assert launched.output.startswith("error: stack Trainstack-platform-30b-fp8-Launcher is not deployed")
    assert no_jobs(emulator)


def test_launch_refuses_a_dataset_whose_validation_split_prepare_left_empty(emulator, tmp_path):
    """`data prepare` at its default fraction held out none of a small corpus; a recipe that validates
    on it would end job 1 at step 0, so launch refuses it first, naming the field and the fraction."""
    from trainer.prepare.pipeline import prepare

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(40)))
    prepare([str(corpus)], "bytes", str(tmp_path / "prepared"), workers=1)  # default fraction, 0.005
    s3 = emulator.client("s3")
    for path in (tmp_path / "prepared").rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"corpus/{path.relative_to(tmp_path / 'prepared')}")
    recipe = tmp_path / "validates.yaml"
    recipe.write_text(
        f"name: validates\nextends: 1b-bf16\ndata: {{train_s3_uri: s3://{BUCKET}/corpus/}}\n"
        "validation: {every_steps: 5, batches: 1}\ntraining: {seq_len: 64, micro_batch: 1, global_batch: 8, "
        "steps: 10}\n"
    )
    launched = cli(emulator, "launch", str(recipe))
    assert launched.exit_code == 2, launched.output
    assert len(launched.output.strip().splitlines()) == 1
    assert launched.output.startswith(
        f"error: validation: data.train_s3_uri: s3://{BUCKET}/corpus/manifest.json: the validation split "
        "holds no document (--validation-fraction 0.005 held out none"
    )
    assert no_jobs(emulator)
