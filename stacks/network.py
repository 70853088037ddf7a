"""Optional VPC mode: private subnets without internet, an EFA security group, VPC endpoints.

Training containers get no route to the internet: S3 through a gateway endpoint, ECR, CloudWatch
Logs/metrics, STS and the SageMaker API through interface endpoints (each costs about 7-8 USD a
month per AZ plus data). EFA needs all traffic allowed between members of one security group.
"""

from __future__ import annotations

from aws_cdk import RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from stacks import nag
from stacks.roles import service_role

INTERFACE_ENDPOINTS = {
    "EcrApi": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDocker": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Monitoring": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_MONITORING,
    "Sts": ec2.InterfaceVpcEndpointAwsService.STS,
    "SageMakerApi": ec2.InterfaceVpcEndpointAwsService.SAGEMAKER_API,
}


class TrainingNetwork(Construct):
    def __init__(self, scope: Construct, id: str, *, key: kms.IKey) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        flow_logs = logs.LogGroup(
            self,
            "FlowLogs",
            encryption_key=key,
            retention=logs.RetentionDays.ONE_YEAR,
            removal_policy=RemovalPolicy.RETAIN,
        )
        # Only this account's flow logs may assume the delivery role (VPC user guide, IAM role for flow
        # logs: aws:SourceAccount and aws:SourceArn against the confused deputy).
        flow_logs_role = service_role(
            self,
            "FlowLogsRole",
            "vpc-flow-logs.amazonaws.com",
            "VPC flow logs of the training network to its log group",
            source_arn=stack.format_arn(service="ec2", resource="vpc-flow-log", resource_name="*"),
            account=stack.account,
        )
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            max_azs=2,
            nat_gateways=0,
            subnet_configuration=[
                ec2.SubnetConfiguration(
                    name="Training", subnet_type=ec2.SubnetType.PRIVATE_ISOLATED, cidr_mask=20
                )
            ],
            flow_logs={
                "All": ec2.FlowLogOptions(
                    destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs, flow_logs_role)
                )
            },
        )
        self.security_group = ec2.SecurityGroup(
            self,
            "Efa",
            vpc=self.vpc,
            allow_all_outbound=False,
            description="EFA: all traffic between training nodes",
        )
        self.security_group.add_ingress_rule(self.security_group, ec2.Port.all_traffic(), "EFA between nodes")
        self.security_group.add_egress_rule(self.security_group, ec2.Port.all_traffic(), "EFA between nodes")
        # The subnets have no route to the internet, so HTTPS egress reaches only the S3 gateway and
        # the interface endpoints below (S3's addresses are a regional prefix list CloudFormation
        # cannot look up without a Lambda, hence any-IPv4 on 443 rather than a prefix list).
        self.security_group.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "AWS APIs via endpoints")
        endpoints_sg = ec2.SecurityGroup(
            self,
            "Endpoints",
            vpc=self.vpc,
            allow_all_outbound=False,
            description="VPC endpoints: HTTPS from training nodes",
        )
        endpoints_sg.add_ingress_rule(self.security_group, ec2.Port.tcp(443), "HTTPS from training nodes")
        nag.acknowledge(endpoints_sg, "AwsSolutions-EC23:endpoint-ingress")
        self.vpc.add_gateway_endpoint(
            "S3",
            service=ec2.GatewayVpcEndpointAwsService.S3,
            subnets=[ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_ISOLATED)],
        )
        for name, service in INTERFACE_ENDPOINTS.items():
            self.vpc.add_interface_endpoint(
                name, service=service, security_groups=[endpoints_sg], private_dns_enabled=True
            )
        self.subnet_ids = [s.subnet_id for s in self.vpc.isolated_subnets]
        self.vpc_arn = stack.format_arn(service="ec2", resource="vpc", resource_name=self.vpc.vpc_id)
        self.subnet_arns = [
            stack.format_arn(service="ec2", resource="subnet", resource_name=i) for i in self.subnet_ids
        ]
        self.security_group_arn = stack.format_arn(
            service="ec2", resource="security-group", resource_name=self.security_group.security_group_id
        )
