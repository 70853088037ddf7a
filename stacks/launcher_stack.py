"""The launcher stack: execution role, image, state machine, optional VPC, launch-on-deploy, monitoring."""

from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, Duration, Fn, Stack
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks.data_stack import DataStack
from stacks.execution_role import ExecutionRole
from stacks.image import TrainingImage
from stacks.launch_on_deploy import DEPLOY_SUFFIX, LaunchOnDeploy
from stacks.network import TrainingNetwork
from stacks.state_machine import (
    ATTEMPT_JOB_NAME_PATH,
    HYPERPARAMETERS_EXPRESSION,
    JOB_NAME_PATH,
    TrainingStateMachine,
)
from trainstack import naming
from trainstack.config import Deployment, Network
from trainstack.recipe import to_hyperparameters
from trainstack.request import (
    INPUT_KEEP_ALIVE,
    Runtime,
    create_training_job_request,
    execution_input,
    job_name,
    stopping_condition,
)

# State machine timeout beyond the job's own limit: creation retries and polling slack.
TIMEOUT_SLACK = Duration.days(1)


class LauncherStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        deployment: Deployment,
        network: Network,
        data: DataStack,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, id, description=f"trainstack {deployment.stack_prefix}: launcher", **kwargs)
        self.add_stack_dependency(data)
        recipe, team = deployment.recipe, deployment.team
        key = data.exports.key(self)
        bucket = data.exports.bucket(self, key)
        repository = data.exports.repository(self)
        prefix = naming.job_name_prefix(recipe, team)

        self.execution_role = ExecutionRole(
            self,
            "Execution",
            deployment=deployment,
            bucket=bucket,
            key=key,
            bucket_arn_export=data.exports.name("BucketArn"),
            vpc=network.vpc,
        ).role
        image = TrainingImage(self, "Image", source=deployment.image, repository=repository)
        image.grant_pull(self.execution_role)

        vpc_args: dict[str, Any] = {}
        if network.vpc:
            net = TrainingNetwork(self, "Network", key=key)
            vpc_args = dict(
                subnet_ids=net.subnet_ids,
                security_group_ids=[net.security_group.security_group_id],
                network_isolation=network.network_isolation,
                inter_container_encryption=network.inter_container_encryption,
            )

        request = create_training_job_request(
            recipe,
            team,
            job_name=Runtime(ATTEMPT_JOB_NAME_PATH),
            checkpoint_name=Runtime(JOB_NAME_PATH),
            role_arn=self.execution_role.role_arn,
            image_uri=image.image_uri,
            bucket_name=bucket.bucket_name,
            kms_key_arn=key.key_arn,
            hyperparameters=Runtime(HYPERPARAMETERS_EXPRESSION),
            keep_alive_seconds=Runtime(f"$.{INPUT_KEEP_ALIVE}"),
            **vpc_args,
        )
        stop = stopping_condition(recipe)
        job_seconds = stop.get("MaxWaitTimeInSeconds", stop["MaxRuntimeInSeconds"])
        self.launcher = TrainingStateMachine(
            self,
            "Launcher",
            request=request,
            hyperparameters=to_hyperparameters(recipe),
            execution_role=self.execution_role,
            job_name_prefix=prefix,
            key=key,
            timeout=Duration.seconds(job_seconds).plus(TIMEOUT_SLACK),
        )
        self.state_machine = self.launcher.state_machine

        if recipe.launch_on_deploy:
            LaunchOnDeploy(
                self,
                "LaunchOnDeploy",
                state_machine=self.state_machine,
                execution_input=execution_input(
                    job_name(recipe, team, DEPLOY_SUFFIX), {}, recipe.compute.keep_alive_seconds
                ),
            )

        # Monitoring adds key-policy statements (SNS, EventBridge, CloudWatch), so it gets the key itself.
        self.monitoring = self._compose_monitoring(deployment, data.key, bucket)

        CfnOutput(self, "StateMachineArn", value=self.state_machine.state_machine_arn)
        CfnOutput(self, "JobNamePrefix", value=prefix)
        CfnOutput(self, "RecipeHash", value=deployment.recipe_hash)
        CfnOutput(self, "ExecutionRoleArn", value=self.execution_role.role_arn)

    @property
    def availability_zones(self) -> list[str]:
        # The region's first two AZs resolved by CloudFormation (Fn::GetAZs), so VPC mode needs no
        # account lookup at synthesis and no hard-coded zone names (cfn-lint W3010).
        return [Fn.select(0, Fn.get_azs()), Fn.select(1, Fn.get_azs())]

    def _compose_monitoring(self, deployment: Deployment, key: kms.IKey, bucket: s3.IBucket) -> Any:
        """Composition point for stacks/monitoring.py (dashboard, alarms, notifications)."""
        from stacks.monitoring import Monitoring

        return Monitoring(
            self,
            "Monitoring",
            recipe=deployment.recipe,
            team=deployment.team,
            plan=deployment.plan,
            state_machine=self.state_machine,
            key=key,
            checkpoint_bucket=bucket,
        )
