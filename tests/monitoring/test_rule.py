"""The job state rule: matches AWS's own event sample for this recipe's jobs, not another recipe's.

Matching uses moto's EventBridge pattern matcher (the one its PutEvents routes with; it implements
prefix, anything-but, exists, numeric, wildcard) on the pattern exactly as synthesized into the
template, and, end to end, a rule created from that pattern routing the documented event sample to a
queue through moto's PutEvents.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import boto3
import pytest
from monitoring_helpers import synth
from moto import mock_aws
from moto.events.models import EventPattern

from trainstack.naming import job_name_prefix
from trainstack.recipe import to_hyperparameters
from trainstack.request import job_name

SAMPLE = json.loads((Path(__file__).parent / "data" / "sagemaker_training_job_state_change.json").read_text())


def event_for(name: str, status: str, reason: str | None = None, recipe=None) -> dict:
    """AWS's sample event, for job `name`; with `recipe`, carrying the hyperparameters the launcher
    gives that recipe's jobs (else the sample's own, which name no recipe)."""
    event = copy.deepcopy(SAMPLE)
    if recipe is not None:
        event["detail"]["HyperParameters"] = to_hyperparameters(recipe)
    event["detail"]["TrainingJobName"] = name
    event["detail"]["TrainingJobArn"] = f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}"
    event["resources"] = [event["detail"]["TrainingJobArn"]]
    event["detail"]["TrainingJobStatus"] = status
    event["detail"]["SecondaryStatus"] = status
    if reason:
        event["detail"]["FailureReason"] = reason
    return event


@pytest.fixture(scope="module")
def s():
    return synth("30b-fp8")


@pytest.fixture(scope="module")
def rule(s):
    (props,) = [
        r["Properties"] for k, r in s.resources("AWS::Events::Rule").items() if "JobStateChanged" in k
    ]
    return props


@pytest.fixture(scope="module")
def matches(rule):
    pattern = EventPattern.load(json.dumps(rule["EventPattern"]))
    return pattern.matches_event


def test_put_events_routes_this_recipes_failure_and_nothing_else(s, rule):
    from trainstack.loader import resolve

    with mock_aws():
        events = boto3.client("events", region_name="us-east-1")
        sqs = boto3.client("sqs", region_name="us-east-1")
        queue = sqs.create_queue(QueueName="notifications")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        events.put_rule(Name="JobStateChanged", EventPattern=json.dumps(rule["EventPattern"]))
        events.put_targets(Rule="JobStateChanged", Targets=[{"Id": "q", "Arn": arn}])
        ours = event_for(
            job_name(s.recipe, None, "a1"), "Failed", "AlgorithmError: NCCL timeout", recipe=s.recipe
        )
        other = resolve("7b-bf16").recipe
        theirs = event_for(job_name(other, None, "a1"), "Failed", recipe=other)
        for event in (theirs, ours):
            events.put_events(
                Entries=[
                    {
                        "Source": event["source"],
                        "DetailType": event["detail-type"],
                        "Detail": json.dumps(event["detail"]),
                        "Resources": event["resources"],
                    }
                ]
            )
        received = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
        names = [json.loads(m["Body"])["detail"]["TrainingJobName"] for m in received]
        assert names == [ours["detail"]["TrainingJobName"]]


def test_matches_this_recipes_failed_stopped_and_completed_jobs(s, matches):
    name = job_name(s.recipe, None, "a1")
    assert matches(event_for(name, "Failed", "AlgorithmError: NCCL timeout", recipe=s.recipe))
    assert matches(event_for(name, "Stopped", recipe=s.recipe))
    assert matches(event_for(name, "Completed", recipe=s.recipe))
    # AWS's sample carries hyperparameters that name no recipe: the prefix decides
    assert matches(event_for(name, "Failed"))


def test_ignores_progress_states(s, matches):
    name = job_name(s.recipe, None, "a1")
    assert not matches(event_for(name, "InProgress"))
    assert not matches(event_for(name, "Stopping"))


def test_ignores_other_recipes_and_teams(s, matches):
    from trainstack.loader import resolve

    other = resolve("7b-bf16").recipe
    assert not matches(event_for(job_name(other, None, "a1"), "Failed"))
    assert not matches(event_for(job_name(other, None, "a1"), "Failed", recipe=other))
    assert not matches(event_for(job_name(s.recipe, "nlp", "a1"), "Failed"))  # same recipe, another team
    assert not matches(event_for("89c96cc8-dded-4739-afcc-6f1dc936701d", "Failed"))  # AWS's own sample job


def test_the_job_name_prefix_tells_the_recipe_apart_from_one_extending_its_name():
    from trainstack.loader import resolve

    s = synth("8b-fp8")
    (props,) = [
        r["Properties"] for k, r in s.resources("AWS::Events::Rule").items() if "JobStateChanged" in k
    ]
    assert props["EventPattern"]["detail"]["TrainingJobName"] == [{"prefix": job_name_prefix(s.recipe, None)}]
    match = EventPattern.load(json.dumps(props["EventPattern"])).matches_event
    longer = resolve("8b-fp8-128k").recipe
    theirs = job_name(longer, None, "a1")
    assert theirs.startswith("ts-platform-8b-fp8-")  # the names overlap as strings ...
    assert not theirs.startswith(job_name_prefix(s.recipe, None))  # ... the prefix does not
    # with or without the hyperparameters that name the recipe: the name alone decides
    assert not match(event_for(theirs, "Failed", recipe=longer))
    assert not match(event_for(theirs, "Failed"))
    assert match(event_for(job_name(s.recipe, None, "a1"), "Failed", recipe=s.recipe))
    assert match(event_for(job_name(s.recipe, None, "a1"), "Failed"))
    # the same holds for the rule that puts and deletes the run alarms
    (run_rule,) = [
        r["Properties"] for k, r in s.resources("AWS::Events::Rule").items() if "RunStateChanged" in k
    ]
    run_match = EventPattern.load(json.dumps(run_rule["EventPattern"])).matches_event
    assert not run_match(event_for(theirs, "Failed", recipe=longer))
    assert not run_match(event_for(theirs, "Failed"))
    assert run_match(event_for(job_name(s.recipe, None, "a1"), "Failed", recipe=s.recipe))


def test_a_short_tuning_run_is_still_this_recipes(s, matches):
    """`trainstack launch --max-steps` changes training.steps (and the job's hash), not the name."""
    short = s.recipe.model_copy(update={"training": s.recipe.training.model_copy(update={"steps": 50})})
    assert matches(event_for(job_name(short, None, "t1"), "Completed", recipe=short))


def test_ignores_other_event_types(s, matches):
    event = event_for(job_name(s.recipe, None, "a1"), "Failed")
    event["detail-type"] = "SageMaker Transform Job State Change"
    assert not matches(event)


def test_the_message_names_job_recipe_team_reason_and_checkpoint(s, rule):
    (target,) = rule["Targets"]
    transformer = target["InputTransformer"]
    paths = transformer["InputPathsMap"]
    assert set(paths.values()) >= {
        "$.detail.TrainingJobName",
        "$.detail.TrainingJobStatus",
        "$.detail.FailureReason",
    }
    template = json.dumps(transformer["InputTemplate"])
    assert f"recipe {s.recipe.name} (team {s.recipe.tags.team})" in template
    assert "Failure reason" in template
    # The checkpoint location is the one the request builder gives each job: <bucket>/<prefix>/<job>.
    assert "trainstack-checkpoints-example" in template
    assert f"checkpoints/{s.recipe.tags.team}/{s.recipe.name}/<detail-TrainingJobName>" in template
    (topic_id,) = s.resources("AWS::SNS::Topic")
    assert target["Arn"] == {"Ref": topic_id}


def test_checkpoint_location_in_the_message_is_the_jobs_checkpoint_uri(s):
    from trainstack.request import create_training_job_request

    name = job_name(s.recipe, None, "a1")
    try:
        request = create_training_job_request(
            s.recipe,
            None,
            job_name=name,
            role_arn="arn:aws:iam::123456789012:role/r",
            image_uri="img:1",
            bucket_name="trainstack-checkpoints-example",
        )
    except TypeError as error:  # the request builder's signature is the cdk engineer's; say what broke
        pytest.fail(f"create_training_job_request signature changed: {error}")
    from trainstack.naming import checkpoint_prefix

    assert request["CheckpointConfig"]["S3Uri"] == (
        f"s3://trainstack-checkpoints-example/{checkpoint_prefix(s.recipe, None)}/{name}"
    )


def test_topic_is_kms_encrypted_and_ssl_only(s):
    ((_, topic),) = s.resources("AWS::SNS::Topic").items()
    (key_id,) = s.resources("AWS::KMS::Key")
    assert topic["Properties"]["KmsMasterKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    (policy,) = s.resources("AWS::SNS::TopicPolicy").values()
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    assert any(
        st["Effect"] == "Deny" and st["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        for st in statements
    )
    # EventBridge (granted by CDK's SnsTopic target) and CloudWatch alarms may use the key to publish,
    # and nothing more.
    key_policy = s.resources("AWS::KMS::Key")[key_id]["Properties"]["KeyPolicy"]["Statement"]
    publish = [
        st
        for st in key_policy
        if st.get("Principal", {}).get("Service") in ("events.amazonaws.com", "cloudwatch.amazonaws.com")
    ]
    assert {st["Principal"]["Service"] for st in publish} == {
        "events.amazonaws.com",
        "cloudwatch.amazonaws.com",
    }
    allowed = {"kms:Decrypt", "kms:GenerateDataKey", "kms:GenerateDataKey*"}
    assert all(set(st["Action"]) <= allowed for st in publish)
    (alarms,) = [st for st in publish if st["Principal"]["Service"] == "cloudwatch.amazonaws.com"]
    assert alarms["Condition"] == {"StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}}


def test_email_subscription_comes_from_the_recipe():
    s = synth("30b-fp8", overrides=("monitoring.notification_email=oncall@example.com",))
    (sub,) = s.resources("AWS::SNS::Subscription").values()
    assert sub["Properties"]["Protocol"] == "email" and sub["Properties"]["Endpoint"] == "oncall@example.com"
    assert synth("30b-fp8").resources("AWS::SNS::Subscription") == {}
