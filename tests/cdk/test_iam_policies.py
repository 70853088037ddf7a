"""Policy gates on the synthesized templates that cdk-nag and cfn-lint do not make:

- every service principal, in a resource policy (key, bucket, topic policies) or a role's trust policy,
  is bound to its source with aws:SourceArn or aws:SourceAccount, except where AWS documents otherwise;
- no statement grants an action under a condition key that action never carries (parliament's
  "unknown condition for action" finding: such a grant silently never applies), checked against the IAM
  action and condition-key definitions that the parliament package ships.

The emulator accepts policies it does not evaluate (../shared/README.md section 12), so these are the gate.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("cdk-synth")]
POLICY_PROPERTIES = ("KeyPolicy", "PolicyDocument", "AssumeRolePolicyDocument")
SOURCE_KEYS = {"aws:sourcearn", "aws:sourceaccount"}


@pytest.fixture(scope="module")
def vpc_templates(vpc_tracking_templates: dict[str, dict]) -> dict[str, dict]:
    """VPC mode adds the flow-logs role and the execution role's network-interface statements; its recipe
    also tracks in the team's MLflow App (the tracking stack, the App's role, the MLflow grant)."""
    return vpc_tracking_templates


@pytest.fixture(scope="module")
def every_template(all_templates: dict, vpc_templates: dict) -> dict[str, dict]:
    return {**all_templates, **{f"{name} (VPC)": t for name, t in vpc_templates.items()}}


def statements(every: dict[str, dict]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """(stack, logical id, resource type, statement) for every policy statement of every template."""
    for stack, template in every.items():
        for logical_id, resource in template.get("Resources", {}).items():
            props = resource.get("Properties", {})
            documents = [props[p] for p in POLICY_PROPERTIES if p in props]
            documents += [p["PolicyDocument"] for p in props.get("Policies", [])]
            for document in documents:
                for statement in document.get("Statement", []):
                    yield stack, logical_id, resource["Type"], statement


def service_principals(statement: dict[str, Any]) -> list[str]:
    principal = statement.get("Principal")
    services = principal.get("Service", []) if isinstance(principal, dict) else []
    return [services] if isinstance(services, str) else list(services)


def condition_keys(statement: dict[str, Any]) -> set[str]:
    return {key.lower() for operator in (statement.get("Condition") or {}).values() for key in operator}


def unconditioned(every: dict[str, dict]) -> set[tuple[str, str, str, str]]:
    """(stack, logical id, type, principal) of Allow statements with a service principal and no source key,
    less the documented exceptions (asserted on their own below)."""
    found = set()
    for stack, logical_id, type_, statement in statements(every):
        if statement.get("Effect") != "Allow":
            continue
        for principal in service_principals(statement):
            if condition_keys(statement) & SOURCE_KEYS or _documented_exception(type_, principal, statement):
                continue
            found.add((stack, logical_id, type_, principal))
    return found


def _documented_exception(type_: str, principal: str, statement: dict[str, Any]) -> bool:
    if type_ != "AWS::KMS::Key":
        return False
    if principal == "events.amazonaws.com":
        # SNS developer guide, key management, "Enable compatibility between event sources from AWS
        # services and encrypted topics": "Adding the aws:SourceAccount and aws:SourceArn to a AWS KMS
        # policy is not supported for EventBridge-to-encrypted topics." With one, delivery silently stops.
        return True
    if re.fullmatch(r"logs\.[a-z0-9-]+\.amazonaws\.com", principal):
        # CloudWatch Logs scopes a key to log groups through the encryption context it sends
        # (kms:EncryptionContext:aws:logs:arn; CloudWatch Logs user guide, encrypt log data with KMS).
        return "kms:encryptioncontext:aws:logs:arn" in condition_keys(statement)
    return False


def test_every_service_principal_is_bound_to_its_source(every_template: dict) -> None:
    found = unconditioned(every_template)
    assert found == set(), "\n".join(map(str, sorted(found)))


def test_the_key_grants_eventbridge_nothing_since_the_supervisor_publishes_itself(
    all_templates: dict,
) -> None:
    """Notifications are published by the run supervisor's own role (it knows why a job ended), not by an
    EventBridge rule, so the key needs no statement for events.amazonaws.com. Were one added (an
    EventBridge-to-SNS rule), it would be the documented exception above: no source condition, or
    delivery silently stops."""
    found = [
        (stack, statement)
        for stack, _, type_, statement in statements(all_templates)
        if type_ == "AWS::KMS::Key" and "events.amazonaws.com" in service_principals(statement)
    ]
    assert found == []
    assert _documented_exception("AWS::KMS::Key", "events.amazonaws.com", {"Condition": {}})


def test_sagemaker_may_assume_the_execution_role_only_for_this_recipes_jobs(every_template: dict) -> None:
    roles = [
        (stack, statement)
        for stack, logical_id, type_, statement in statements(every_template)
        if type_ == "AWS::IAM::Role" and "sagemaker.amazonaws.com" in service_principals(statement)
    ]
    assert roles
    for stack, statement in roles:
        condition = statement["Condition"]
        assert condition["StringEquals"]["aws:SourceAccount"]
        source = json.dumps(condition["ArnLike"]["aws:SourceArn"])
        name = stack.split(" ")[0]
        if name.endswith("-Tracking"):  # the team's MLflow App role: this account's Apps
            assert ":mlflow-app/*" in source, (stack, source)
            continue
        prefix = name.removeprefix("Trainstack-").split("-Launcher")[0].split("-Data")[0]  # <team>-<recipe>
        if name.endswith("-Data"):  # the processing role (stacks/processing_role.py): data prepare jobs
            assert f":processing-job/ts-prep-{prefix}--*" in source, (stack, source)
        else:
            assert f":training-job/ts-{prefix}--*" in source, (stack, source)
    assert any(stack.split(" ")[0].endswith("-Data") for stack, _ in roles)  # nlp's 8b-fp8 names a corpus


def test_vpc_mode_scopes_network_interfaces_to_this_deployment(vpc_templates: dict) -> None:
    (launcher,) = [t for name, t in vpc_templates.items() if name.endswith("-Launcher")]
    found = [
        s
        for _, logical_id, _, s in statements({"l": launcher})
        if logical_id.startswith("ExecutionPolicy") and "ec2" in json.dumps(s["Action"])
    ]
    by_action = {
        a: s for s in found for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }
    create = by_action["ec2:CreateNetworkInterface"]
    resources = json.dumps(create["Resource"])
    assert ":subnet/" in resources and ":security-group/" in resources and ":network-interface/*" in resources
    assert '"*"' not in resources
    for action in ("ec2:CreateNetworkInterfacePermission", "ec2:DeleteNetworkInterface"):
        assert "vpc/" in json.dumps(by_action[action]["Condition"]["ArnEquals"]["ec2:Vpc"])
    for action in (a for a, s in by_action.items() if s["Resource"] == "*"):
        assert action.startswith("ec2:Describe") or action == "ec2:DeleteNetworkInterfacePermission"


# --- parliament-style: condition keys the actions carry ----------------------------------------


@cache
def iam_definitions() -> dict[str, dict]:
    """service prefix -> its definition, from the parliament package's data (not imported: its
    __init__ needs pkg_resources, which current setuptools no longer ships)."""
    spec = importlib.util.find_spec("parliament")
    assert spec is not None and spec.origin, "pip install -e '.[dev]' (parliament)"
    data = json.loads((Path(spec.origin).parent / "iam_definition.json").read_text())
    return {service["prefix"]: service for service in data}


def expand(action: str) -> list[str]:
    prefix, _, name = action.partition(":")
    service = iam_definitions().get(prefix.lower())
    if service is None:
        return []
    return [
        f"{prefix}:{p['privilege']}"
        for p in service["privileges"]
        if fnmatch.fnmatchcase(p["privilege"].lower(), name.lower())
    ]


def supports(action: str, key: str) -> bool:
    """Whether IAM ever puts `key` into the request context of `action` (global aws: keys always may)."""
    if key.lower().startswith("aws:"):
        return True
    prefix, _, name = action.partition(":")
    service = iam_definitions()[prefix.lower()]
    (privilege,) = [p for p in service["privileges"] if p["privilege"].lower() == name.lower()]
    resource_keys = {r["resource"]: r["condition_keys"] for r in service["resources"]}
    keys: set[str] = set()
    for resource in privilege["resource_types"]:
        keys.update(resource["condition_keys"])
        keys.update(resource_keys.get(resource["resource_type"].rstrip("*"), []))
    patterns = [re.escape(k).replace(r"\$\{", "${").replace(r"\}", "}") for k in keys]
    patterns = [re.sub(r"\$\{[^}]*\}", ".+", p) for p in patterns]
    return any(re.fullmatch(p, key, re.IGNORECASE) for p in patterns)


def condition_findings(statement: dict[str, Any]) -> list[tuple[str, str]]:
    """(action, condition key) pairs where the key never applies to the action."""
    if statement.get("Effect") != "Allow" or not statement.get("Condition"):
        return []
    actions = statement.get("Action", [])
    actions = [actions] if isinstance(actions, str) else actions
    found = []
    for key in {k for operator in statement["Condition"].values() for k in operator}:
        for pattern in actions:
            expanded = expand(pattern)
            if not expanded and not key.lower().startswith("aws:"):
                found.append((pattern, f"{key} (action unknown to the IAM definitions)"))
            found += [(action, key) for action in expanded if not supports(action, key)]
    return found


def test_the_finding_is_live_for_describekey_under_a_grant_condition() -> None:
    grant = {
        "Effect": "Allow",
        "Action": ["kms:CreateGrant", "kms:DescribeKey"],
        "Resource": "*",
        "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}},
    }
    assert condition_findings(grant) == [("kms:DescribeKey", "kms:GrantIsForAWSResource")]
    logs = {
        "Effect": "Allow",
        "Action": ["kms:Describe*", "kms:Decrypt*"],
        "Condition": {"ArnLike": {"kms:EncryptionContext:aws:logs:arn": "x"}},
    }
    assert sorted(a for a, _ in condition_findings(logs)) == [
        "kms:DescribeCustomKeyStores",
        "kms:DescribeKey",
    ]
    vpc = {
        "Effect": "Allow",
        "Action": "ec2:CreateNetworkInterface",
        "Condition": {"ArnEquals": {"ec2:Vpc": "x"}},
    }
    assert condition_findings(vpc) == []  # the subnet and security group carry ec2:Vpc


def test_no_grant_depends_on_a_condition_key_its_action_never_carries(every_template: dict) -> None:
    found = {
        (stack, logical_id, action, key)
        for stack, logical_id, _, statement in statements(every_template)
        for action, key in condition_findings(statement)
    }
    assert found == set(), "\n".join(map(str, sorted(found)))
