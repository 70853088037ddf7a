"""The job state rule that starts the run supervisor: matches AWS's own event sample for this recipe's
jobs, not another recipe's; and the topic the supervisor and the alarms publish to.

Matching uses moto's EventBridge pattern matcher (the one its PutEvents routes with; it implements
prefix, anything-but, exists, numeric, wildcard) on `job_state_pattern`, the dict the supervisor's rule
is synthesized from (tests/cdk/test_cdk_supervisor.py pins that the template carries exactly it), and,
end to end, a rule created from that pattern routing the documented event sample to a queue through
moto's PutEvents. The run alarms' rule is synthesized here and checked the same way.
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

from stacks.monitoring.patterns import job_state_pattern
from trainstack.aws.request import job_name
from trainstack.recipes.naming import job_name_prefix
from trainstack.recipes.schema import to_hyperparameters

pytestmark = pytest.mark.fast

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
    return {"EventPattern": job_state_pattern(job_name_prefix(s.recipe, None))}


@pytest.fixture(scope="module")
def matches(rule):
    pattern = EventPattern.load(json.dumps(rule["EventPattern"]))
    return pattern.matches_event


def test_put_events_routes_this_recipes_failure_and_nothing_else(s, rule):
    from trainstack.recipes.loader import resolve

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
    from trainstack.recipes.loader import resolve

    other = resolve("7b-bf16").recipe
    assert not matches(event_for(job_name(other, None, "a1"), "Failed"))
    assert not matches(event_for(job_name(other, None, "a1"), "Failed", recipe=other))
    assert not matches(event_for(job_name(s.recipe, "nlp", "a1"), "Failed"))  # same recipe, another team
    assert not matches(event_for("89c96cc8-dded-4739-afcc-6f1dc936701d", "Failed"))  # AWS's own sample job


def test_the_job_name_prefix_tells_the_recipe_apart_from_one_extending_its_name():
    from trainstack.recipes.loader import resolve

    s = synth("8b-fp8")
    props = {"EventPattern": job_state_pattern(job_name_prefix(s.recipe, None))}
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


@pytest.mark.parametrize("which", ["NotificationsTopic", "SupervisionTopic"])
def test_topic_is_kms_encrypted_and_ssl_only(s, which):
    """Both topics: the deployment's (its key), and the supervision alarms' (a key of its own, so a
    disabled deployment key does not silence the alarm that reports failed notifications)."""
    ((topic_id, topic),) = [(k, t) for k, t in s.resources("AWS::SNS::Topic").items() if which in k]
    keys = [k for k in s.resources("AWS::KMS::Key") if ("Supervision" in k) == (which == "SupervisionTopic")]
    (key_id,) = keys
    assert topic["Properties"]["KmsMasterKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    (policy,) = [
        p
        for p in s.resources("AWS::SNS::TopicPolicy").values()
        if p["Properties"]["Topics"] == [{"Ref": topic_id}]
    ]
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    assert any(
        st["Effect"] == "Deny" and st["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        for st in statements
    )
    # CloudWatch alarms may publish and use the key to do it, and nothing more.
    key_policy = s.resources("AWS::KMS::Key")[key_id]["Properties"]["KeyPolicy"]["Statement"]
    publish = [
        st for st in key_policy if st.get("Principal", {}).get("Service") == "cloudwatch.amazonaws.com"
    ]
    (alarms,) = publish
    assert set(alarms["Action"]) == {"kms:Decrypt", "kms:GenerateDataKey"}
    (topic_publish,) = [st for st in statements if service_of(st)]
    assert topic_publish["Principal"] == {"Service": "cloudwatch.amazonaws.com"}
    assert topic_publish["Action"] == "sns:Publish"


def service_of(statement: dict):
    principal = statement.get("Principal")
    return principal.get("Service") if isinstance(principal, dict) else None


def service_statements(s):
    """(where, statement) for every statement of a topic policy or key policy naming a service principal."""
    for resource in s.template["Resources"].values():
        props = resource.get("Properties", {})
        where = {"AWS::SNS::TopicPolicy": "topic", "AWS::KMS::Key": "key"}.get(resource["Type"])
        if where is None:
            continue
        document = props["PolicyDocument"] if where == "topic" else props["KeyPolicy"]
        for statement in document["Statement"]:
            services = service_of(statement)
            if services:
                yield where, statement, services if isinstance(services, list) else [services]


def test_service_principals_in_topic_policies_carry_a_source_and_eventbridge_key_grants_do_not(s):
    """SNS documents aws:SourceArn / aws:SourceAccount as the guard for services publishing to a topic,
    and the same for CloudWatch's use of the key; for EventBridge's use of the key they must be absent:
    EventBridge's requests to KMS carry neither, so delivery would stop silently (SNS developer guide,
    "Enable compatibility between event sources from AWS services and encrypted topics")."""
    checked = 0
    for where, statement, services in service_statements(s):
        keys = {k for condition in statement.get("Condition", {}).values() for k in condition}
        guarded = bool(keys & {"aws:SourceArn", "aws:SourceAccount"})
        if where == "key" and "events.amazonaws.com" in services:
            assert not guarded, statement
        elif where == "topic" or services == ["cloudwatch.amazonaws.com"]:
            assert guarded, statement
            checked += 1
    assert checked >= 2  # the topic's and the key's statements for CloudWatch
    # No rule targets the topic any more: the supervisor publishes its decisions itself.
    assert not [r for r in s.resources("AWS::Events::Rule").values() if "Sns" in json.dumps(r)]


def test_email_subscription_comes_from_the_recipe():
    s = synth("30b-fp8", overrides=("monitoring.notification_email=oncall@example.com",))
    subscriptions = s.resources("AWS::SNS::Subscription").values()
    assert len(subscriptions) == 2  # the deployment's topic and the supervision topic
    for sub in subscriptions:
        assert sub["Properties"]["Protocol"] == "email"
        assert sub["Properties"]["Endpoint"] == "oncall@example.com"
    assert synth("30b-fp8").resources("AWS::SNS::Subscription") == {}
