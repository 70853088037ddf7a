"""A dataset the trainer would refuse at step 0 is refused before the launch, in one line naming the
recipe field: datasets written by the real `data prepare` (trainer.prepare.pipeline), uploaded to S3
(moto's in-process S3, as the emulator's), read back where the job would read them."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from moto import mock_aws
from trainer.prepare.pipeline import prepare

from trainstack.aws.dataset_check import check_datasets, dataset_problem
from trainstack.errors import TrainstackError
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast
BUCKET = "corpora"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """60 short documents: at the default fraction (0.005) none is held out, at 0.5 about half."""
    root = tmp_path_factory.mktemp("corpus")
    lines = [
        json.dumps({"text": f"document {i}: " + "the quick brown fox " * (i % 7 + 1)}) for i in range(60)
    ]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return root / "docs.jsonl"


def prepared(corpus: Path, out: Path, fraction: float) -> Path:
    prepare([str(corpus)], "bytes", str(out), validation_fraction=fraction, workers=1)
    return out


def upload(s3, folder: Path, prefix: str) -> str:
    for path in folder.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder)}")
    return f"s3://{BUCKET}/{prefix}/"


VALIDATES = ("validation.every_steps=100", "validation.batches=1")


def recipe_on(uri: str, *sets: str, validates: bool = True):
    """1b-bf16 on `uri`, evaluating every 100 steps unless `validates` is False."""
    return resolve(
        "1b-bf16", overrides=[f"data.train_s3_uri={uri}", *(VALIDATES if validates else ()), *sets]
    ).recipe


@pytest.fixture
def s3():
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


@pytest.fixture(scope="module")
def datasets(corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prepared")
    return {
        "none-held-out": prepared(corpus, root / "default", 0.005),
        "half-held-out": prepared(corpus, root / "half", 0.5),
        "no-split": prepared(corpus, root / "none", 0.0),
    }


def test_a_validation_split_that_prepare_left_empty_is_refused_naming_the_fraction(s3, datasets):
    held = json.loads((datasets["none-held-out"] / "manifest.json").read_text())["validation"]
    assert held["documents"] == 0  # the real pipeline's hash split held out none of 60 at 0.005
    uri = upload(s3, datasets["none-held-out"], "default")
    recipe = recipe_on(uri)
    assert recipe.validation is not None
    with pytest.raises(TrainstackError) as refused:
        check_datasets(recipe, s3)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"validation: data.train_s3_uri: {uri}manifest.json: the validation split holds")
    assert "--validation-fraction 0.005 held out none" in line and "after the nodes are paid for" in line


def test_a_dataset_with_held_out_documents_passes(s3, datasets):
    uri = upload(s3, datasets["half-held-out"], "half")
    check_datasets(recipe_on(uri), s3)


def test_a_dataset_without_a_validation_split_is_refused_only_when_the_recipe_validates(s3, datasets):
    uri = upload(s3, datasets["no-split"], "none")
    with pytest.raises(TrainstackError, match="the dataset has no validation split"):
        check_datasets(recipe_on(uri), s3)
    check_datasets(recipe_on(uri, validates=False), s3)


def test_shards_of_another_tokenizer_are_refused_as_the_trainer_refuses_them(s3, datasets):
    uri = upload(s3, datasets["half-held-out"], "half")
    other = "sha256:" + "0" * 64
    with pytest.raises(TrainstackError) as refused:
        check_datasets(recipe_on(uri, f"data.tokenizer={other}"), s3)
    assert f"the shards were made with tokenizer bytes, data.tokenizer is {other}" in str(refused.value)
    check_datasets(recipe_on(uri, "data.tokenizer=bytes"), s3)


def test_a_text_dataset_under_sft_is_refused_and_a_prefix_without_a_manifest_is_not_checked(
    s3, datasets, tmp_path
):
    manifest = json.loads((datasets["half-held-out"] / "manifest.json").read_text())
    sft = recipe_on("s3://corpora/half/", "training.objective=sft", f"model.init_from={tmp_path}")
    problem = dataset_problem(sft, manifest, "s3://corpora/half/manifest.json", "data.train_s3_uri")
    assert problem is not None and "a text dataset; training.objective sft" in problem
    # shards of another tool: nothing to read, nothing refused (the trainer warns the same way)
    s3.put_object(Bucket=BUCKET, Key="megatron/shard_00000.bin", Body=b"\0" * 8)
    check_datasets(recipe_on("s3://corpora/megatron/"), s3)
