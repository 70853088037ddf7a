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
from conftest import synth
from moto import mock_aws
from moto.events.models import EventPattern

from trainstack.request import job_name

SAMPLE = json.loads((Path(__file__).parent / "data" / "sagemaker_training_job_state_change.json").read_text())


def event_for(name: str, status: str, reason: str | None = None) -> dict:
    event = copy.deepcopy(SAMPLE)
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
    (props,) = [r["Properties"] for r in s.resources("AWS::Events::Rule").values()]
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
        ours = event_for(job_name(s.recipe, None, "a1"), "Failed", "AlgorithmError: NCCL timeout")
        theirs = event_for(job_name(resolve("7b-bf16").recipe, None, "a1"), "Failed")
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
    assert matches(event_for(name, "Failed", "AlgorithmError: NCCL timeout"))
    assert matches(event_for(name, "Stopped"))
    assert matches(event_for(name, "Completed"))


def test_ignores_progress_states(s, matches):
    name = job_name(s.recipe, None, "a1")
    assert not matches(event_for(name, "InProgress"))
    assert not matches(event_for(name, "Stopping"))


def test_ignores_other_recipes_and_teams(s, matches):
    from trainstack.loader import resolve

    other = resolve("7b-bf16").recipe
    assert not matches(event_for(job_name(other, None, "a1"), "Failed"))
    assert not matches(event_for(job_name(s.recipe, "nlp", "a1"), "Failed"))  # same recipe, another team
    assert not matches(event_for("89c96cc8-dded-4739-afcc-6f1dc936701d", "Failed"))  # AWS's own sample job


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
    # EventBridge and CloudWatch may use the key to publish, and nothing else is granted.
    key_policy = s.resources("AWS::KMS::Key")[key_id]["Properties"]["KeyPolicy"]["Statement"]
    services = {st["Principal"]["Service"] for st in key_policy if "Service" in st.get("Principal", {})}
    assert services == {"events.amazonaws.com", "cloudwatch.amazonaws.com"}


def test_email_subscription_comes_from_the_recipe():
    s = synth("30b-fp8", overrides=("monitoring.notification_email=oncall@example.com",))
    (sub,) = s.resources("AWS::SNS::Subscription").values()
    assert sub["Properties"]["Protocol"] == "email" and sub["Properties"]["Endpoint"] == "oncall@example.com"
    assert synth("30b-fp8").resources("AWS::SNS::Subscription") == {}
