"""One logged, traced state machine builder for the run supervisor and the alarm manager.

Every state machine here runs short executions that end (no polling loop: stacks/supervisor/), logs
ALL (execution data included) to a retained, KMS-encrypted log group, traces with X-Ray, and runs as a
role that only Step Functions of this account may assume.
"""

from __future__ import annotations

import json
from typing import Any

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.roles import service_role


def logged_state_machine(
    scope: Construct,
    *,
    log_group_id: str,
    state_machine_id: str,
    definition: sfn.IChainable | dict[str, Any],
    key: kms.IKey,
    retention: logs.RetentionDays,
    timeout: Duration,
    description: str = "",
) -> tuple[logs.LogGroup, sfn.StateMachine]:
    """A state machine that logs ALL (execution data included) to a retained, KMS-encrypted log group,
    with X-Ray tracing. Both are created directly in `scope` under the given IDs (logical IDs stay).
    `definition` is a chain of CDK states or an Amazon States Language document (CDK tokens allowed)."""
    log_group = logs.LogGroup(
        scope, log_group_id, encryption_key=key, retention=retention, removal_policy=RemovalPolicy.RETAIN
    )
    if isinstance(definition, dict):
        # json.dumps, not Stack.to_json_string: that drops nulls, and `"ResultPath": null` (keep the
        # state's input, discard the task's result) would become the default, `$`. CDK tokens in the
        # text (`${Token[...]}`) still resolve: CDK finds them in any string.
        body = sfn.DefinitionBody.from_string(json.dumps(definition))
    else:
        body = sfn.DefinitionBody.from_chainable(definition)
    role = service_role(
        scope,
        f"{state_machine_id}Role",
        "states.amazonaws.com",
        description or f"{state_machine_id} executions",
    )
    state_machine = sfn.StateMachine(
        scope,
        state_machine_id,
        definition_body=body,
        role=role,
        timeout=timeout,
        tracing_enabled=True,
        logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
    )
    # CDK adds DependsOn the role next to the GetAtt of its ARN; cfn-lint flags the duplicate (W3005).
    # Keep only the dependency on the role's policy, which the GetAtt does not imply.
    policy = role.node.find_child("DefaultPolicy").node.default_child
    state_machine.node.default_child.add_override("DependsOn", [Stack.of(scope).get_logical_id(policy)])
    return log_group, state_machine
