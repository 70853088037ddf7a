"""The launcher stack: execution role, image, optional VPC, notifications, the run supervisor,
launch-on-deploy, alarms and dashboard."""

from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, Fn, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks.data_stack import DataStack
from stacks.execution_role import ExecutionRole
from stacks.export import ExportMachine, export_on_complete_state
from stacks.image import TrainingImage
from stacks.launch_on_deploy import DEPLOY_SUFFIX, LaunchOnDeploy
from stacks.network import TrainingNetwork
from stacks.supervisor import RunSupervisor
from stacks.supervisor.asl import (
    CHECKPOINT_URI_PATH,
    HYPERPARAMETERS_EXPRESSION,
    JOB_NAME_PATH,
    KEEP_ALIVE_PATH,
    RUN_PATH,
    constants_for,
)
from stacks.tracking import allow_tracking
from trainstack.aws.deployment import Deployment, Network
from trainstack.aws.request import Runtime, create_training_job_request, execution_input
from trainstack.aws.tracking import mlflow_arn_export, team_of
from trainstack.recipes import naming
from trainstack.recipes.schema import to_hyperparameters


class LauncherStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        deployment: Deployment,
        network: Network,
        data: DataStack,
        tracking: Stack | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, id, description=f"trainstack {deployment.stack_prefix}: launcher", **kwargs)
        self.add_stack_dependency(data)
        if tracking is not None:  # the team's MLflow App (stacks/tracking.py): deployed first
            self.add_stack_dependency(tracking)
        recipe, team = deployment.recipe, deployment.team
        key = data.exports.key(self)
        bucket = data.exports.bucket(self, key)
        repository = data.exports.repository(self)
        prefix = naming.job_name_prefix(recipe, team)

        self.execution = ExecutionRole(
            self,
            "Execution",
            deployment=deployment,
            bucket=bucket,
            key=key,
            bucket_arn_export=data.exports.name("BucketArn"),
            vpc=network.vpc,
        )
        self.execution_role = self.execution.role
        image = TrainingImage(self, "Image", source=deployment.image, repository=repository)
        image.grant_pull(self.execution_role)

        # Monitoring adds key-policy statements (SNS, CloudWatch), so it gets the key itself. Its topic
        # comes first: the supervisor publishes to it; its alarms and dashboard watch the supervisor.
        self.monitoring = self._compose_monitoring(deployment, data.key, bucket)
        table = data.exports.run_table(self, key)
        self.export = ExportMachine(
            self,
            "Export",
            recipe=recipe,
            team=team,
            job_name_prefix=prefix,
            bucket_name=bucket.bucket_name,
            image_uri=image.image_uri,
            execution_role=self.execution_role,
            key=key,
            table=table,
            table_name=data.exports.value("RunTableName"),
            topic=self.monitoring.topic,
        )
        on_complete = export_on_complete_state(self.export.state_machine.state_machine_arn)
        self.supervisor = RunSupervisor(
            self,
            "Supervisor",
            constants=constants_for(
                recipe,
                team,
                deployment.plan,
                table_name=data.exports.value("RunTableName"),
                topic_arn=self.monitoring.topic.topic_arn,
                bucket_name=bucket.bucket_name,
            ),
            request=self._request(deployment, network, image.image_uri, bucket, key),
            hyperparameters=to_hyperparameters(recipe),
            execution_role=self.execution_role,
            job_name_prefix=prefix,
            key=key,
            table=table,
            topic=self.monitoring.topic,
            # Deployed whatever the recipe says: each run's recorded request decides (export.on_complete).
            on_complete=on_complete,
        )
        self.export.allow_start(self.supervisor.job_ended)
        self.state_machine = self.supervisor.start_job
        self.monitoring.watch(
            {
                "start": self.supervisor.start_job,
                "decide": self.supervisor.job_ended,
                "reconcile": self.supervisor.reconcile,
                "stalled": self.supervisor.stop_stalled,
            },
            self.supervisor.rule,
        )

        if recipe.launch_on_deploy:
            run_id = naming.default_run_id(recipe, DEPLOY_SUFFIX)
            LaunchOnDeploy(
                self,
                "LaunchOnDeploy",
                state_machine=self.state_machine,
                execution_input=execution_input(
                    naming.run_name(recipe, team, run_id),
                    run_id,
                    1,
                    recipe.training.steps,
                    {},
                    recipe.compute.keep_alive_seconds,
                    change={"Who": "launch on deploy", "What": f"launch of recipe {deployment.recipe_hash}"},
                ),
            )

        CfnOutput(self, "StateMachineArn", value=self.state_machine.state_machine_arn)
        CfnOutput(self, "JobEndedStateMachineArn", value=self.supervisor.job_ended.state_machine_arn)
        CfnOutput(self, "ExportStateMachineArn", value=self.export.state_machine.state_machine_arn)
        CfnOutput(self, "ReconcileStateMachineArn", value=self.supervisor.reconcile.state_machine_arn)
        CfnOutput(self, "JobNamePrefix", value=prefix)
        CfnOutput(self, "RecipeHash", value=deployment.recipe_hash)
        CfnOutput(self, "ExecutionRoleArn", value=self.execution_role.role_arn)
        CfnOutput(self, "TopicArn", value=self.monitoring.topic.topic_arn)
        CfnOutput(self, "ImageUri", value=image.image_uri)  # `trainstack data prepare` runs this image too

    @property
    def availability_zones(self) -> list[str]:
        # The region's first two AZs resolved by CloudFormation (Fn::GetAZs), so VPC mode needs no
        # account lookup at synthesis and no hard-coded zone names (cfn-lint W3010).
        return [Fn.select(0, Fn.get_azs()), Fn.select(1, Fn.get_azs())]

    def _request(
        self, deployment: Deployment, network: Network, image_uri: str, bucket: s3.IBucket, key: kms.IKey
    ) -> dict[str, Any]:
        """The CreateTrainingJob request of every job, with the run's values filled in at run time."""
        vpc_args: dict[str, Any] = {}
        if network.vpc:
            net = TrainingNetwork(self, "Network", key=key)
            self.execution.allow_network_interfaces(net)
            vpc_args = dict(
                subnet_ids=net.subnet_ids,
                security_group_ids=[net.security_group.security_group_id],
                network_isolation=network.network_isolation,
                inter_container_encryption=network.inter_container_encryption,
            )
        role: iam.IRole = self.execution_role
        mlflow_arn = self._mlflow_arn(deployment)
        return create_training_job_request(
            deployment.recipe,
            deployment.team,
            job_name=Runtime(JOB_NAME_PATH),
            run=Runtime(RUN_PATH),
            checkpoint_uri=Runtime(CHECKPOINT_URI_PATH),
            role_arn=role.role_arn,
            image_uri=image_uri,
            bucket_name=bucket.bucket_name,
            kms_key_arn=key.key_arn,
            hyperparameters=Runtime(HYPERPARAMETERS_EXPRESSION),
            keep_alive_seconds=Runtime(KEEP_ALIVE_PATH),
            region=self.region,
            mlflow_arn=mlflow_arn,
            **vpc_args,
        )

    def _mlflow_arn(self, deployment: Deployment) -> str | None:
        """The tracker the jobs log to (the team's managed App, or the recipe's ARN), granted to the
        execution role on exactly that resource; None when the recipe does not track in MLflow."""
        tracking = deployment.recipe.tracking
        if tracking.managed:
            team = team_of(deployment.recipe, deployment.team)
            arn = Fn.import_value(mlflow_arn_export(team))
        elif tracking.mlflow_arn:
            arn = tracking.mlflow_arn
        else:
            return None
        allow_tracking(self.execution.policy, arn, app=tracking.managed or ":mlflow-app/" in arn)
        return arn

    def _compose_monitoring(self, deployment: Deployment, key: kms.IKey, bucket: s3.IBucket) -> Any:
        """Composition point for stacks/monitoring (notifications now; alarms and dashboard by watch())."""
        from stacks.monitoring import Monitoring

        return Monitoring(
            self,
            "Monitoring",
            recipe=deployment.recipe,
            team=deployment.team,
            plan=deployment.plan,
            key=key,
            checkpoint_bucket=bucket,
        )
