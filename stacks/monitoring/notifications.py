"""Notifications: a KMS-encrypted SNS topic for the run supervisor's decisions and the alarms."""

from __future__ import annotations

from aws_cdk import Aws
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subs
from constructs import Construct

from trainstack.recipes.schema import Recipe


def alarm_arns() -> str:
    """Every CloudWatch alarm of this account and region (alarm names are generated or per job)."""
    return f"arn:{Aws.PARTITION}:cloudwatch:{Aws.REGION}:{Aws.ACCOUNT_ID}:alarm:*"


class Notifications(Construct):
    """A KMS-encrypted, SSL-only SNS topic and an optional e-mail subscription.

    Who publishes: the run supervisor's state machines (stacks/supervisor/), once per ended job, naming
    the run, the job, why it ended and what happens next; and CloudWatch, for the alarms. No
    EventBridge rule targets the topic any more (the supervisor's message needs its decision).

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
        team_name = team or recipe.tags.team
        self.checkpoint_bucket = checkpoint_bucket
        self.topic = sns.Topic(
            self,
            "Topic",
            display_name=f"trainstack {team_name}/{recipe.name}",
            master_key=key,
            enforce_ssl=True,
        )
        # CloudWatch alarms publish to an encrypted topic only if the topic policy lets
        # cloudwatch.amazonaws.com publish and the key policy lets it use the key (SNS developer guide,
        # "Enable compatibility between event sources from AWS services and encrypted topics"). Both
        # are conditioned on this account's alarms (aws:SourceAccount, aws:SourceArn), the
        # confused-deputy guard SNS documents for service principals. The key usually lives in the
        # stateful stack: naming this stack's alarms there would make the stacks depend on each other
        # both ways, hence every alarm of the account and region rather than these alarms' ARNs.
        source = {
            "StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID},
            "ArnLike": {"aws:SourceArn": alarm_arns()},
        }
        self.topic.add_to_resource_policy(
            iam.PolicyStatement(
                sid="AlarmsPublish",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["sns:Publish"],
                resources=[self.topic.topic_arn],
                conditions=source,
            )
        )
        slug = f"{recipe.name}{team_name}".replace("-", "")
        key.add_to_resource_policy(
            iam.PolicyStatement(
                sid=f"AlarmsPublish{slug}",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=["*"],  # in a key policy "*" means this key
                conditions=source,
            )
        )
        # Were an EventBridge rule ever to target this topic again: its key-policy statement for
        # events.amazonaws.com must carry no aws:SourceArn / aws:SourceAccount, which (as reported for
        # EventBridge deliveries) its requests to KMS do not include, so delivery would stop silently
        # (SNS developer guide, same section; EventBridge user guide, "Using resource-based policies for
        # Amazon EventBridge", Amazon SNS permissions). Its topic-policy statement can and should carry
        # them. tests/monitoring/test_rule.py pins both rules for every statement of both policies.
        if recipe.monitoring.notification_email:
            self.topic.add_subscription(subs.EmailSubscription(recipe.monitoring.notification_email))
        self.supervision_topic = self._supervision_topic(recipe, team_name, source)

    def _supervision_topic(self, recipe: Recipe, team_name: str, source: dict) -> sns.Topic:
        """Who hears that the notifier itself failed: a second topic, for the alarms on the supervisor
        only, encrypted with a key of its own. A deleted topic, or the deployment key disabled, silences
        the first topic and every publish to it (the supervisor's and the alarms'); this one still
        reaches the same address."""
        key = kms.Key(
            self,
            "SupervisionKey",
            description=f"trainstack {team_name}/{recipe.name}: the supervision alarms' topic",
            enable_key_rotation=True,
        )
        key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="AlarmsPublish",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=["*"],  # in a key policy "*" means this key
                conditions=source,
            )
        )
        topic = sns.Topic(
            self,
            "SupervisionTopic",
            display_name=f"trainstack {team_name}/{recipe.name} supervision",
            master_key=key,
            enforce_ssl=True,
        )
        topic.add_to_resource_policy(
            iam.PolicyStatement(
                sid="AlarmsPublish",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["sns:Publish"],
                resources=[topic.topic_arn],
                conditions=source,
            )
        )
        if recipe.monitoring.notification_email:
            topic.add_subscription(subs.EmailSubscription(recipe.monitoring.notification_email))
        return topic
