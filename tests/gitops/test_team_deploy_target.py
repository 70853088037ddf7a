"""A team's defaults name where its stacks go (`deploy: {account, region}`); the CDK app, the pipeline
stages and the deploy workflow's matrix all follow it, and the local emulator ignores it."""

from __future__ import annotations

import pytest

from stacks.pipeline import rollouts
from trainstack.aws.deployment import load
from trainstack.gitops import gitdiff

pytestmark = pytest.mark.fast

IMAGE = {"image_uri": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainstack:test"}
ENV = {"CDK_DEFAULT_ACCOUNT": "111111111111", "CDK_DEFAULT_REGION": "us-west-2"}


@pytest.fixture
def recipes(tmp_path, monkeypatch, h):
    monkeypatch.chdir(tmp_path)
    return h.write_tree(
        tmp_path,
        {
            "recipes/small.yaml": h.base_recipe("small"),
            "recipes/teams/vision/defaults.yaml": 'deploy: {account: "222222222222", region: eu-west-1}\n',
        },
    )


def test_the_app_deploys_a_team_where_its_defaults_say(recipes):
    config = load({"recipe": "small", "team": "vision", **IMAGE}, ENV, recipes_dir=str(recipes))
    assert (config.account, config.region) == ("222222222222", "eu-west-1")
    # Without a team, or with teams that disagree, the deployer's own account and region.
    config = load({"recipe": "small", **IMAGE}, ENV, recipes_dir=str(recipes))
    assert (config.account, config.region) == ("111111111111", "us-west-2")
    config = load({"recipe": "all", **IMAGE}, ENV, recipes_dir=str(recipes))
    assert (config.account, config.region) == ("111111111111", "us-west-2")
    assert {(r.team, r.account, r.region) for r in rollouts(config)} == {
        ("platform", "111111111111", "us-west-2"),
        ("vision", "222222222222", "eu-west-1"),
    }


def test_the_emulator_ignores_deploy_targets(recipes):
    config = load(
        {"recipe": "small", "team": "vision", "emulator": "true", **IMAGE}, ENV, recipes_dir=str(recipes)
    )
    assert (config.account, config.region) == ("111111111111", "us-west-2")


def test_the_deploy_matrix_carries_the_region(recipes, h):
    root = recipes.parent
    h.git(root, "init", "--quiet")
    h.git(root, "add", ".")
    h.git(root, "commit", "--quiet", "-m", "recipes")
    (recipes / "teams/vision/defaults.yaml").write_text(
        'deploy: {account: "222222222222", region: eu-central-1}\n'
    )
    (job,) = gitdiff.compute("HEAD", root).matrix()["include"]
    assert (job["stack"], job["account"], job["region"]) == (
        "Trainstack-vision-small",
        "222222222222",
        "eu-central-1",
    )
