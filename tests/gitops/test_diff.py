"""`trainstack diff`: on a git repository, exactly the recipe/team stacks a merge changes, with the
planner's before/after figures (computed here with trainstack.planner.plan, never written down)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack.errors import TrainstackError
from trainstack.gitops import gitdiff
from trainstack.gitops import report as diff_report
from trainstack.planner import plan
from trainstack.recipes import naming
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

TREE = {
    "recipes/small.yaml": None,  # filled in by the fixture with the helpers' base recipe
    "recipes/medium.yaml": None,
    "recipes/teams/nlp/defaults.yaml": "tags: {cost_center: nlp}\n",
    "recipes/teams/nlp/small.yaml": "training: {micro_batch: 2}\n",
    "recipes/teams/vision/defaults.yaml": "tags: {cost_center: vision}\nbudget: {approval_usd: 0}\n",
    "app.py": "# stands in for the CDK app\n",
}


@pytest.fixture
def repo(tmp_path, h):
    """A committed repository, plus `before`: an untouched copy of its recipes to plan expectations from."""
    files = {
        **TREE,
        "recipes/small.yaml": h.base_recipe("small"),
        "recipes/medium.yaml": h.base_recipe("medium", micro_batch=2, nodes=2),
    }
    root = tmp_path / "repo"
    h.write_tree(root, files)
    h.git(root, "init", "--quiet")
    h.git(root, "add", ".")
    h.git(root, "commit", "--quiet", "-m", "recipes")
    before = h.write_tree(tmp_path / "before", files)
    return root, before


def expected_figures(recipes_dir: Path, recipe: str, team: str | None) -> gitdiff.Figures:
    p = plan(resolve(recipe, team=team, recipes_dir=recipes_dir).recipe)
    return gitdiff.Figures(
        fits=p.fits,
        peak_gib=p.memory.peak_gib,
        usable_gib=p.memory.usable_gib,
        tokens_per_sec_per_gpu=p.throughput.tokens_per_sec_per_gpu,
        mfu=p.throughput.mfu,
        hours=p.cost.hours,
        total_usd=p.cost.total_usd,
        tokens_per_sec_per_gpu_range=tuple(p.throughput.tokens_per_sec_per_gpu_range),
        hours_range=tuple(p.cost.hours_range),
        total_usd_range=tuple(p.cost.total_usd_range),
    )


def deployed(diff: gitdiff.PlanDiff) -> set[str]:
    return {t.stack for t in diff.deploys}


def test_changed_team_defaults_deploy_exactly_that_teams_stacks_with_right_figures(repo):
    root, before = repo
    nlp_defaults = root / "recipes/teams/nlp/defaults.yaml"
    nlp_defaults.write_text("tags: {cost_center: nlp}\ntraining: {steps: 5000}\n")
    diff = gitdiff.compute("HEAD", root)

    assert deployed(diff) == {"Trainstack-nlp-small", "Trainstack-nlp-medium"}
    assert {t.stack for t in diff.shown} == deployed(diff)
    assert diff.changed_files == ("recipes/teams/nlp/defaults.yaml",)
    for t in diff.deploys:
        assert (t.recipe, t.team, t.status) in {("small", "nlp", "changed"), ("medium", "nlp", "changed")}
        assert t.reasons == ("recipes/teams/nlp/defaults.yaml",)
        assert t.before.figures == expected_figures(before, t.recipe, "nlp")
        assert t.after.figures == expected_figures(root / "recipes", t.recipe, "nlp")
        # More steps: the same speed and memory, a longer and dearer run.
        assert t.after.figures.hours > t.before.figures.hours
        assert t.after.figures.total_usd > t.before.figures.total_usd
        assert t.after.figures.tokens_per_sec_per_gpu == t.before.figures.tokens_per_sec_per_gpu


def test_changed_base_recipe_deploys_it_for_every_team(repo):
    root, before = repo
    (root / "recipes/small.yaml").write_text(
        (before / "small.yaml").read_text().replace("micro_batch: 4", "micro_batch: 8")
    )
    diff = gitdiff.compute("HEAD", root)
    # nlp overrides micro_batch itself, so its small recipe resolves to the same thing: no deploy.
    assert deployed(diff) == {"Trainstack-platform-small", "Trainstack-vision-small"}
    for t in diff.deploys:
        assert t.before.figures == expected_figures(before, "small", t.team)
        assert t.after.figures == expected_figures(root / "recipes", "small", t.team)
        assert t.after.figures.peak_gib > t.before.figures.peak_gib  # twice the activations per GPU


def test_team_change_that_resolves_to_the_same_recipe_deploys_nothing(repo):
    root, _ = repo
    (root / "recipes/teams/nlp/small.yaml").write_text("training: {micro_batch: 2}  # unchanged value\n")
    diff = gitdiff.compute("HEAD", root)
    assert diff.changed_files == ("recipes/teams/nlp/small.yaml",)
    assert diff.deploys == () and diff.shown == ()
    assert "A merge deploys no stacks." in diff_report.to_markdown(diff)


def test_new_team_adds_its_stacks_and_infra_code_redeploys_everything(repo, h):
    root, _ = repo
    h.write_tree(root, {"recipes/teams/speech/defaults.yaml": "tags: {cost_center: speech}\n"})
    diff = gitdiff.compute("HEAD", root)
    assert {(t.stack, t.status) for t in diff.deploys} == {
        ("Trainstack-speech-small", "added"),
        ("Trainstack-speech-medium", "added"),
    }
    assert all(t.before is None for t in diff.deploys)

    (root / "app.py").write_text("# changed\n")
    diff = gitdiff.compute("HEAD", root, synth=False)  # templates not compared: everything redeploys
    assert len(diff.deploys) == len(diff.targets) == 8  # 2 base x (no team, nlp, vision, speech)
    assert {t.status for t in diff.deploys} == {"added", "code"}
    assert diff.infra_files == ("app.py",) and "--no-synth" in diff.templates
    # this stand-in repository has no CDK app to synthesize: the diff says so and stays conservative
    fallback = gitdiff.compute("HEAD", root)
    assert len(fallback.deploys) == 8 and fallback.templates.startswith("templates not compared (")


def test_removed_and_invalid_targets_are_shown_but_not_deployed(repo):
    root, _ = repo
    (root / "recipes/medium.yaml").unlink()
    (root / "recipes/teams/nlp/small.yaml").write_text("training: {micro_batch: 3}\n")
    diff = gitdiff.compute("HEAD", root)
    status = {t.stack: t.status for t in diff.shown}
    assert status == {
        "Trainstack-platform-medium": "removed",
        "Trainstack-nlp-medium": "removed",
        "Trainstack-vision-medium": "removed",
        "Trainstack-nlp-small": "invalid",
    }
    assert diff.deploys == ()
    invalid = next(t for t in diff.shown if t.status == "invalid")
    assert invalid.reasons == ("recipes/teams/nlp/small.yaml",)
    assert invalid.after.error.startswith("recipes/small.yaml: training.global_batch: 256 is not a multiple")
    markdown = diff_report.to_markdown(diff)
    assert "Invalid targets block the merge" in markdown and "not destroyed by a merge" in markdown


def test_markdown_json_and_cli_tell_the_same_story(repo):
    root, before = repo
    (root / "recipes/teams/vision/defaults.yaml").write_text(
        "tags: {cost_center: vision}\nbudget: {approval_usd: 0}\ntraining: {steps: 3000}\n"
    )
    diff = gitdiff.compute("HEAD", root)
    assert deployed(diff) == {"Trainstack-vision-small", "Trainstack-vision-medium"}

    markdown = diff_report.to_markdown(diff)
    headline = "A merge deploys 2 recipe/team stack set(s): Trainstack-vision-medium, Trainstack-vision-small"
    assert diff_report.headline(diff) == headline
    assert f"**{headline}**" in markdown
    for t in diff.deploys:
        b, a = t.before.figures, t.after.figures
        assert f"| {t.stack} | changed (recipes/teams/vision/defaults.yaml) |" in markdown
        # every speed, time and cost with the planner's range
        hours = [f"{f.hours:,.1f} ({f.hours_range[0]:,.1f}-{f.hours_range[1]:,.1f})" for f in (b, a)]
        assert diff_report.ARROW.join(hours) in markdown
        usd = [
            f"${f.total_usd:,.0f} (${f.total_usd_range[0]:,.0f}-{f.total_usd_range[1]:,.0f})" for f in (b, a)
        ]
        assert diff_report.ARROW.join(usd) in markdown
        low, high = a.tokens_per_sec_per_gpu_range
        assert low < a.tokens_per_sec_per_gpu < high

    cli = shutil.which("trainstack", path=str(Path(sys.executable).parent))
    done = subprocess.run(
        [cli, "diff", "--base", "HEAD", "--json", "--repo", str(root)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["deploy_count"] == 2
    assert data["matrix"] == json.loads(json.dumps(diff.matrix()))
    assert {m["environment"] for m in data["matrix"]["include"]} == {"training-approval"}  # approval_usd: 0
    assert {(m["recipe"], m["team"]) for m in data["matrix"]["include"]} == {
        ("small", "vision"),
        ("medium", "vision"),
    }

    done = subprocess.run(
        [cli, "diff", "--base", "HEAD", "--markdown", "--repo", str(root)], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == markdown.strip()
    summary = root.parent / "summary.md"
    summary.write_text("earlier step\n")
    done = subprocess.run(
        [cli, "diff", "--base", "HEAD", "--json", "--summary", str(summary), "--repo", str(root)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["deploy_count"] == 2
    assert summary.read_text() == "earlier step\n" + markdown + "\n"  # appended, as GitHub expects

    # The terminal table: the same figures, before above `→ after`, within 120 columns.
    done = subprocess.run(
        [cli, "diff", "--base", "HEAD", "--repo", str(root)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(x) for x in lines) <= 120
    for t in diff.deploys:
        short = t.stack.removeprefix(diff_report.STACK_PREFIX)
        (line,) = [x for x in lines if f" {short} " in x]  # one line, never broken
        below = lines[lines.index(line) + 1]
        assert f"{t.before.figures.hours:,.1f}" in line and f"→ {t.after.figures.hours:,.1f}" in below
        assert f"→ ${t.after.figures.total_usd:,.0f}" in below
        assert f"{t.stack} changed by recipes/teams/vision/defaults.yaml." in lines
    assert "Recipe files changed: recipes/teams/vision/defaults.yaml." in lines
    assert lines[-1] == headline


def test_unknown_base_ref_is_one_line_and_exit_2(repo):
    root, _ = repo
    with pytest.raises(TrainstackError, match=r"^--base: 'no-such-branch' is not a commit in "):
        gitdiff.compute("no-such-branch", root)
    cli = shutil.which("trainstack", path=str(Path(sys.executable).parent))
    done = subprocess.run(
        [cli, "diff", "--base", "no-such-branch", "--repo", str(root)], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "not a commit" in done.stderr and "Traceback" not in done.stderr


def test_a_budget_change_deploys_nothing_and_keeps_run_names_but_a_new_region_redeploys(repo):
    root, before = repo
    vision = root / "recipes/teams/vision/defaults.yaml"
    vision.write_text("tags: {cost_center: vision}\nbudget: {approval_usd: 1, max_run_usd: 1000000}\n")
    diff = gitdiff.compute("HEAD", root)
    assert diff.deploys == ()  # caps are policy: the runs and their names (recipe_hash) are unchanged
    old = resolve("small", team="vision", recipes_dir=before).recipe
    new = resolve("small", team="vision", recipes_dir=root / "recipes").recipe
    assert old.budget != new.budget and naming.recipe_hash(old) == naming.recipe_hash(new)

    vision.write_text("tags: {cost_center: vision}\nbudget: {approval_usd: 0}\ndeploy: {region: eu-west-1}\n")
    diff = gitdiff.compute("HEAD", root)
    assert deployed(diff) == {"Trainstack-vision-small", "Trainstack-vision-medium"}
    assert {job["region"] for job in diff.matrix()["include"]} == {"eu-west-1"}


def test_missing_repo_directory_is_named_not_blamed_on_git(tmp_path):
    with pytest.raises(TrainstackError, match=r"^--repo: .*/nope is not a directory$"):
        gitdiff.compute("main", tmp_path / "nope")
