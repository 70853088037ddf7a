"""`trainstack diff` on infrastructure changes: both sides synthesized with the same CDK CLI, templates
compared per stack. A refactor that leaves every template identical deploys nothing; a change that
alters one stack set's template deploys exactly that one, naming the files and the resources.

The repository is this project (git archive of HEAD) cut down to two base recipes and no teams, so
each synthesis covers four stacks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from trainstack.gitops import gitdiff, template_diff
from trainstack.gitops import report as diff_report

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
KEEP = ("1b-bf16", "3b-bf16")


@pytest.fixture
def project(tmp_path, h) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive.stdout, check=True)
    for path in (repo / "recipes").glob("*.yaml"):
        if path.stem not in KEEP:
            path.unlink()
    subprocess.run(["rm", "-rf", str(repo / "recipes" / "teams")], check=True)
    (repo / "node_modules").symlink_to(ROOT / "node_modules")  # this checkout's CDK CLI
    h.git(repo, "init", "--quiet")
    (repo / ".git" / "info" / "exclude").write_text("node_modules\n")  # the link, not only the directory
    h.git(repo, "add", ".")
    h.git(repo, "commit", "--quiet", "-m", "base")
    return repo


def test_normalising_drops_only_location_and_cdk_bookkeeping():
    template = {
        "Resources": {
            "Bucket": {"Type": "AWS::S3::Bucket", "Metadata": {"aws:cdk:path": "A/B", "aws:asset:path": "x"}},
            "Fn": {"Type": "AWS::Lambda::Function", "Metadata": {"keep": 1, "aws:cdk:path": "A/F"}},
            "CDKMetadata": {"Type": "AWS::CDK::Metadata", "Properties": {"Analytics": "v2:deflate64:..."}},
        },
        "Conditions": {"CDKMetadataAvailable": {"Fn::Equals": [1, 1]}},
        "Outputs": {"Arn": {"Value": "x"}},
    }
    assert template_diff.normalise(template) == {
        "Resources": {
            "Bucket": {"Type": "AWS::S3::Bucket"},
            "Fn": {"Type": "AWS::Lambda::Function", "Metadata": {"keep": 1}},
        },
        "Outputs": {"Arn": {"Value": "x"}},
    }
    after = {"Resources": {"Fn": {"Type": "AWS::Lambda::Function", "Properties": {"X": 1}}}, "Outputs": {}}
    assert template_diff.changes(template_diff.normalise(template), after) == (
        "Bucket (AWS::S3::Bucket) removed",
        "Fn (AWS::Lambda::Function) modified",
        "Outputs.Arn removed",
    )


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_only_stack_sets_whose_templates_change_deploy(project, h, tmp_path, monkeypatch):
    """Committed: a refactor that keeps every template (a helper renamed, a comment, a CLI change, which
    is outside the training image's build context). Uncommitted on top: a change that reaches the
    3b-bf16 stack set only. One diff against the base, two syntheses."""
    app_py = project / "stacks" / "app.py"
    text = app_py.read_text()
    assert "def stack_names(" in text and "        stacks += [data, launcher]\n" in text
    app_py.write_text(text.replace("stack_names(", "stack_names_of(") + "\n# refactored\n")
    cli_py = project / "trainstack" / "cli" / "main.py"
    cli_py.write_text(cli_py.read_text() + "\n# a CLI refactor: the image is not rebuilt\n")
    h.git(project, "commit", "--quiet", "-am", "refactor")
    anchor = "        stacks += [data, launcher]\n"
    tagged = (
        '        if deployment.recipe.name == "3b-bf16":  # reaches one stack set only\n'
        '            Tags.of(data).add("trainstack:test", "changed")\n'
    )
    app_py.write_text(app_py.read_text().replace(anchor, tagged + anchor, 1))

    keep = tmp_path / "assemblies"
    keep.mkdir()
    compare = template_diff.compare
    monkeypatch.setattr(template_diff, "compare", lambda *a, **k: compare(*a, **k, keep=keep))
    diff = gitdiff.compute("HEAD~1", project)

    # The same code and recipes in two directories: byte-identical templates (nothing path-dependent).
    unchanged = sorted((keep / "base.out").glob("Trainstack-platform-1b-bf16-*.template.json"))
    assert [p.name for p in unchanged] == [
        "Trainstack-platform-1b-bf16-Data.template.json",
        "Trainstack-platform-1b-bf16-Launcher.template.json",
    ]
    for before in unchanged:
        assert before.read_bytes() == (keep / "head.out" / before.name).read_bytes(), before.name

    assert diff.infra_files == ("stacks/app.py", "trainstack/cli/main.py")
    assert [t.stack for t in diff.deploys] == ["Trainstack-platform-3b-bf16"]  # not 1b-bf16: identical
    (target,) = diff.deploys
    assert target.status == "code" and target.reasons == ("stacks/app.py", "trainstack/cli/main.py")
    assert target.resources and all(
        r.startswith("Data: ") and r.endswith(" modified") for r in target.resources
    )
    assert any("(AWS::S3::Bucket)" in r for r in target.resources)
    assert [m["stack"] for m in diff.to_dict()["matrix"]["include"]] == ["Trainstack-platform-3b-bf16"]
    notes = diff_report.notes(diff)
    assert "Infrastructure files changed: stacks/app.py, trainstack/cli/main.py." in notes
    assert any(n.startswith("Template changes in Trainstack-platform-3b-bf16: Data: ") for n in notes)
    assert (
        "Infrastructure files changed: `stacks/app.py`, `trainstack/cli/main.py`."
        in diff_report.to_markdown(diff)
    )
    assert not any("training image rebuilt" in n for n in notes)


def test_the_diff_names_as_image_files_only_what_the_build_context_holds(tmp_path):
    (tmp_path / ".dockerignore").write_text(
        "*\n!trainstack/recipes/schema.py\n!trainstack/planner/\n!recipes/\n**/*.pyc\n"
    )
    changed = (
        "trainstack/cli/main.py",
        "trainstack/recipes/schema.py",
        "trainstack/recipes/keys.py",
        "trainstack/planner/core.py",
        "recipes/1b-bf16.yaml",
        ".dockerignore",
        "stacks/app.py",
    )
    assert gitdiff.image_context_files(tmp_path, changed) == (
        "trainstack/recipes/schema.py",
        "trainstack/planner/core.py",
        ".dockerignore",
    )


def test_identical_templates_are_said_in_the_headline():
    diff = gitdiff.PlanDiff(
        base="main",
        base_commit="0" * 40,
        changed_files=("stacks/app.py",),
        infra_files=("stacks/app.py",),
        templates="templates of both sides synthesized with the same CDK CLI and compared",
    )
    assert diff_report.headline(diff) == (
        "A merge deploys no stacks (infrastructure files changed, every template is identical)."
    )
    fallback = gitdiff.PlanDiff(
        "main", "0" * 40, ("app.py",), infra_files=("app.py",), templates="templates not compared (x)"
    )
    assert diff_report.headline(fallback) == "A merge deploys no stacks."
