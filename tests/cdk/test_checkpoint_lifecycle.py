"""What the checkpoint bucket's lifecycle does, not only that it exists: the synthesized rules of every
data stack, run through an evaluator of S3's documented lifecycle semantics (tests/cdk/s3_lifecycle.py)
over a run's life: checkpoints written, kept, pruned; a killed save; an overwritten model output."""

from __future__ import annotations

import json

import pytest
from cdk_helpers import resources
from s3_lifecycle import Bucket

from trainstack.planner import storage as priced
from trainstack.recipes import naming
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

CHECKPOINT = "checkpoints/platform/30b-fp8/main/step_00000250/__0_0.distcp"
OUTPUT = "output/platform/30b-fp8/ts-platform-30b-fp8--main-1/output/model.tar.gz"
# The rule the bucket had before: 3 noncurrent versions kept per key, then 30 days.
OLD_RULES = [
    {
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 7},
        "NoncurrentVersionExpiration": {"NewerNoncurrentVersions": 3, "NoncurrentDays": 30},
        "Status": "Enabled",
    }
]


@pytest.fixture(scope="module")
def rules(all_templates: dict) -> list[dict]:
    """The checkpoint bucket's lifecycle rules, the same in every data stack of every recipe and team."""
    found = {
        json.dumps(bucket["Properties"]["LifecycleConfiguration"]["Rules"], sort_keys=True)
        for name, template in all_templates.items()
        if name.endswith("-Data")
        for logical, bucket in resources(template, "AWS::S3::Bucket").items()
        if logical.startswith("CheckpointsBucket")
    }
    assert len(found) == 1, found
    return json.loads(found.pop())


def test_the_evaluator_reproduces_the_s3_user_guides_worked_example():
    # Lifecycle configuration elements: a version replaced on 1/15/2014 10:30 UTC under a 3-day rule is
    # acted on at 1/19/2014 00:00 UTC (day 0 = 1/1/2014 00:00 here).
    bucket = Bucket(
        [{"Status": "Enabled", "Prefix": "", "NoncurrentVersionExpiration": {"NoncurrentDays": 3}}]
    )
    bucket.put("a", at=10.5 / 24)
    bucket.put("a", at=14 + 10.5 / 24)
    assert len(bucket.data_versions("a", at=17.999)) == 2
    assert len(bucket.data_versions("a", at=18.0)) == 1


def test_under_the_old_rule_a_pruned_checkpoint_is_never_deleted():
    # Checkpoint keys are unique per step: one noncurrent version each, never 3 newer ones.
    bucket = Bucket(OLD_RULES)
    bucket.put(CHECKPOINT, at=0.4)
    bucket.delete(CHECKPOINT, at=3.2)
    assert len(bucket.data_versions(CHECKPOINT, at=3650.0)) == 1


@pytest.mark.parametrize("pruned_at", [3.0, 3.2, 3.5, 3.999])
def test_a_checkpoint_pruned_on_day_3_stays_recoverable_a_day_and_is_gone_within_two(rules, pruned_at):
    bucket = Bucket(rules)
    bucket.put(CHECKPOINT, at=0.4)
    bucket.delete(CHECKPOINT, at=pruned_at)
    first, last = priced.PRUNED_DAYS_RANGE  # what plan prices: billed 1 to 2 days after the prune
    assert len(bucket.data_versions(CHECKPOINT, at=pruned_at + first - 1e-6)) == 1
    assert bucket.data_versions(CHECKPOINT, at=pruned_at + last) == []
    # the delete marker, then alone, goes at the next daily run: nothing of the key is left
    assert bucket.stored_versions(CHECKPOINT, at=pruned_at + last + 1) == []


def test_a_kept_checkpoint_is_never_expired(rules):
    bucket = Bucket(rules)
    bucket.put(CHECKPOINT, at=0.4)
    (version,) = bucket.stored_versions(CHECKPOINT, at=3650.0)
    assert not version.delete_marker and version.noncurrent_since is None


def test_a_delete_marker_left_alone_is_removed(rules):
    # e.g. a second delete of an already pruned file, or a marker whose version expired
    bucket = Bucket(rules)
    bucket.delete(CHECKPOINT, at=5.5)
    assert len(bucket.stored_versions(CHECKPOINT, at=5.9)) == 1
    assert bucket.stored_versions(CHECKPOINT, at=6.0) == []


def test_a_killed_saves_multipart_upload_is_aborted_within_two_days(rules):
    bucket = Bucket(rules)
    bucket.start_upload(CHECKPOINT, at=2.7)
    assert bucket.upload_open(CHECKPOINT, at=3.6)
    assert not bucket.upload_open(CHECKPOINT, at=2.7 + priced.INCOMPLETE_CHECKPOINT_UPLOAD_DAYS + 1)


def test_an_overwritten_model_output_stays_recoverable_for_30_days(rules):
    bucket = Bucket(rules)
    bucket.put(OUTPUT, at=0.5)
    bucket.put(OUTPUT, at=10.25)  # a later job of the run writes its model again
    assert len(bucket.data_versions(OUTPUT, at=10.25 + priced.OTHER_NONCURRENT_DAYS - 1e-6)) == 2
    assert len(bucket.data_versions(OUTPUT, at=10.25 + priced.OTHER_NONCURRENT_DAYS + 1)) == 1


def test_the_rules_prefix_covers_every_runs_checkpoints():
    recipe = resolve("30b-fp8").recipe
    assert naming.checkpoint_prefix(recipe, "nlp").startswith(priced.CHECKPOINT_PREFIX)
    assert naming.run_checkpoint_prefix(recipe, None, "main").startswith(priced.CHECKPOINT_PREFIX)
