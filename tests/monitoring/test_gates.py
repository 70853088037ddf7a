"""The monitoring construct passes the app's gates: cdk-nag AwsSolutions and cfn-lint, no findings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from monitoring_helpers import synth

pytestmark = pytest.mark.fast

CASES = [("30b-fp8", None), ("8b-fp8", "nlp"), ("1b-bf16", None)]


@pytest.mark.parametrize(("recipe", "team"), CASES)
def test_no_cdk_nag_finding_inside_monitoring(recipe, team):
    s = synth(recipe, team)
    ours = [(rule, path) for rule, path in s.nag_violations if path.startswith("MonitoringTest/Monitoring/")]
    assert ours == []
    # The findings that remain belong to the test's stand-in state machine, never to what we ship.
    assert all(path.startswith("MonitoringTest/Launcher/") for _, path in s.nag_violations)


@pytest.mark.parametrize(("recipe", "team"), CASES)
def test_cfn_lint_is_clean_for_monitoring_resources(recipe, team):
    s = synth(recipe, team)
    lint = Path(sys.executable).parent / "cfn-lint"
    result = subprocess.run(
        [str(lint), "--format", "json", s.template_path], capture_output=True, text=True, timeout=300
    )
    findings = json.loads(result.stdout or "[]")
    ours = [
        f
        for f in findings
        if "/Monitoring" in json.dumps(f.get("Location", {}))
        or any(p.startswith("Monitoring") for p in map(str, f.get("Location", {}).get("Path", [])))
    ]
    assert ours == [], json.dumps(ours, indent=1)
    # Whatever else cfn-lint says concerns the stand-in (CDK's own state machine role dependency).
    assert all(f["Rule"]["Id"] == "W3005" for f in findings), json.dumps(findings, indent=1)
