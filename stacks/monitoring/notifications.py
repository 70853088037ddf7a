"""Notifications: a KMS-encrypted SNS topic and the rule that tells it when a job ends."""

from __future__ import annotations

from aws_cdk import Aws
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subs
from constructs import Construct

from stacks.monitoring.patterns import as_event_pattern, job_state_pattern
from trainstack.naming import checkpoint_prefix, job_name_prefix
from trainstack.recipe import Recipe


class Notifications(Construct):
    """A KMS-encrypted SNS topic, an optional e-mail subscription, and the job state rule.

    The topic is also the place for chat: AWS Chatbot (Amazon Q Developer in chat applications)
    subscribes Slack or Teams channels to an SNS topic without any code in this stack.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        key: kms.IKey,
        checkpoint_bucket: s3.IBucket | None = None,
    ) -> None:
        super().__init__(scope, id)
        prefix = job_name_prefix(recipe, team)
        team_name = team or recipe.tags.team
        self.topic = sns.Topic(
            self,
            "Topic",
            display_name=f"trainstack {team_name}/{recipe.name}",
            master_key=key,
            enforce_ssl=True,
        )
        # CloudWatch alarms publish to an encrypted topic only if they may use the key (the SnsTopic
        # rule target below grants EventBridge itself). Conditioned on this account rather than on the
        # alarm ARNs: the key usually lives in the stateful stack, and naming launcher resources in its
        # policy would make the stacks depend on each other both ways.
        slug = f"{recipe.name}{team_name}".replace("-", "")
        key.add_to_resource_policy(
            iam.PolicyStatement(
                sid=f"AlarmsPublish{slug}",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=["*"],  # in a key policy "*" means this key
                conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}},
            )
        )
        if recipe.monitoring.notification_email:
            self.topic.add_subscription(subs.EmailSubscription(recipe.monitoring.notification_email))

        self.pattern = job_state_pattern(prefix)
        self.rule = events.Rule(
            self,
            "JobStateChanged",
            description=f"Training jobs of {team_name}/{recipe.name} failed, stopped or completed",
            event_pattern=as_event_pattern(self.pattern),
        )
        job = events.EventField.from_path("$.detail.TrainingJobName")
        if checkpoint_bucket is not None:
            # The launcher checkpoints each job under <bucket>/<checkpoint prefix>/<job name>
            # (trainstack.request), so the location is exact whether or not the event carries
            # CheckpointConfig.
            checkpoints = f"s3://{checkpoint_bucket.bucket_name}/{checkpoint_prefix(recipe, team)}/{job}"
        else:
            checkpoints = events.EventField.from_path("$.detail.CheckpointConfig.S3Uri")
        message = (
            f"trainstack: training job {job} of recipe {recipe.name} (team {team_name}) is "
            f"{events.EventField.from_path('$.detail.TrainingJobStatus')} "
            f"({events.EventField.from_path('$.detail.SecondaryStatus')}). "
            f"Failure reason: {events.EventField.from_path('$.detail.FailureReason')}. "
            f"Last checkpoint: the newest step under {checkpoints}. "
            f"Details: trainstack status {recipe.name}{f' --team {team}' if team else ''}; "
            f"trainstack logs {recipe.name}{f' --team {team}' if team else ''} --job {job}"
        )
        self.rule.add_target(targets.SnsTopic(self.topic, message=events.RuleTargetInput.from_text(message)))
