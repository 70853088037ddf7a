"""CDK context -> DeploymentConfig: read once, validated, one clear line for every bad input."""

from __future__ import annotations

import pytest

from trainstack.aws import deployment as config
from trainstack.errors import TrainstackError
from trainstack.recipes.loader import base_recipe_names, team_names, team_recipe_names

pytestmark = pytest.mark.fast

ENV = {"CDK_DEFAULT_ACCOUNT": "123456789012", "CDK_DEFAULT_REGION": "us-west-2"}
DLC = "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.9-gpu-py312"


def load(**context: str) -> config.DeploymentConfig:
    return config.load(context, ENV, base_image_resolver=lambda region, recipe: DLC)


def one_line_error(**context: str) -> str:
    with pytest.raises(TrainstackError) as info:
        load(**context)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_one_recipe_resolves_with_plan_image_and_names() -> None:
    cfg = load(recipe="30b-fp8")
    (d,) = cfg.deployments
    assert d.recipe.name == "30b-fp8" and d.team is None and d.plan.fits
    assert d.stack_prefix == "Trainstack-platform-30b-fp8"
    assert d.image.kind == "build" and d.image.base_image_uri == DLC
    assert (cfg.account, cfg.region, cfg.emulator, cfg.network.vpc) == (
        "123456789012",
        "us-west-2",
        False,
        False,
    )


def test_all_is_every_base_recipe_and_every_team_recipe() -> None:
    cfg = load(recipe="all")
    expected = [(n, None) for n in base_recipe_names()]
    expected += [(n, t) for t in team_names() for n in team_recipe_names(t)]
    assert [(d.recipe.name, d.team) for d in cfg.deployments] == expected
    assert len({d.stack_prefix for d in cfg.deployments}) == len(expected)


def test_team_and_set_layer_onto_the_recipe() -> None:
    (d,) = load(recipe="30b-fp8", team="nlp", set="training.steps=77,checkpointing.keep=5").deployments
    assert d.team == "nlp" and d.recipe.tags.team == "nlp"
    assert d.recipe.training.steps == 77 and d.recipe.checkpointing.keep == 5
    assert d.stack_prefix == "Trainstack-nlp-30b-fp8"


def test_set_splits_only_before_a_key() -> None:
    assert config.split_set("a.b=1,c.d=x") == ["a.b=1", "c.d=x"]
    assert config.split_set("tags.extra={a: 1, b: 2}") == ["tags.extra={a: 1, b: 2}"]
    assert config.split_set("") == []


def test_image_sources() -> None:
    assert (
        load(recipe="30b-fp8", image_uri="123.dkr.ecr.x/y:z").deployments[0].image.uri == "123.dkr.ecr.x/y:z"
    )
    assert load(recipe="30b-fp8", image_tag="v1").deployments[0].image.repository_tag == "v1"
    emulated = load(recipe="30b-fp8", emulator="true")
    assert (
        emulated.emulator
        and emulated.deployments[0].image.repository_tag == emulated.deployments[0].recipe_hash
    )
    implied = config.load({"recipe": "30b-fp8"}, {**ENV, "AWS_ENDPOINT_URL": "http://localhost:5000"})
    assert implied.emulator


def test_vpc_and_encryption_are_explicit_choices() -> None:
    cfg = load(recipe="30b-fp8", vpc="true", inter_container_encryption="true")
    assert cfg.network.vpc and cfg.network.inter_container_encryption and cfg.network.network_isolation


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        ({}, "recipe: required"),
        ({"recipe": "99b-fp4"}, "unknown recipe '99b-fp4'"),
        ({"recipe": "99b-fp4", "team": "nlp"}, "unknown recipe '99b-fp4' for team 'nlp'"),
        ({"recipe": "30b-fp8", "team": "nosuchteam"}, "unknown team 'nosuchteam'"),
        ({"recipe": "30b-fp8", "set": "training.steps"}, "'training.steps' is not key.path=value"),
        ({"recipe": "30b-fp8", "set": "training.bogus=1"}, "training.bogus: unknown key"),
        (
            {"recipe": "30b-fp8", "set": "compute.instance_type=ml.p9.96xlarge"},
            "-c set=compute.instance_type=ml.p9.96xlarge: compute.instance_type: 'ml.p9.96xlarge' is not",
        ),
        (
            {
                "recipe": "30b-fp8",
                # policy block: mode none takes no other policy, whatever the recipe sets
                "set": "activation_checkpointing.mode=none,activation_checkpointing.policy=block,"
                "training.micro_batch=4",
            },
            "does not fit: peak",
        ),
        ({"recipe": "30b-fp8", "vpc": "maybe"}, "vpc: expected true or false"),
        ({"recipe": "30b-fp8", "image_tag": "bad tag"}, "image_tag: 'bad tag' is not a valid image tag"),
    ],
)
def test_bad_input_is_one_line_naming_what_is_wrong(context: dict[str, str], expected: str) -> None:
    assert expected in one_line_error(**context)


def test_a_recipe_that_does_not_fit_names_the_file_and_the_fix() -> None:
    message = one_line_error(
        recipe="30b-fp8",
        set="activation_checkpointing.mode=none,activation_checkpointing.policy=block,training.micro_batch=4",
    )
    assert message.startswith("recipes/30b-fp8.yaml: does not fit") or "30b-fp8" in message.split(":")[0]
    assert "fix:" in message


def test_building_the_image_needs_a_region() -> None:
    with pytest.raises(TrainstackError, match="needs a region"):
        config.load({"recipe": "30b-fp8"}, {}, base_image_resolver=lambda region, recipe: DLC)


def test_the_base_image_comes_from_the_sagemaker_sdk() -> None:
    r = load(recipe="30b-fp8").deployments[0].recipe
    uri = config.resolve_base_image("us-west-2", r, cache=None)
    assert uri.startswith("763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.9")


def test_unknown_context_key_is_refused_but_the_cdks_own_keys_pass() -> None:
    with pytest.raises(
        TrainstackError, match=r"^cdk context: recpie: unknown key \(did you mean recipe\?\)$"
    ):
        load(recipe="30b-fp8", recpie="30b-fp8")
    cdk_own = {
        "recipe": "1b-bf16",
        "aws:cdk:enable-path-metadata": True,
        "@aws-cdk/core:failSynthOnValidationErrors": False,
        "availability-zones:account=123456789012:region=us-east-1": ["us-east-1a"],
    }
    assert config.user_context(cdk_own) == {"recipe": "1b-bf16"}
    assert config.load(config.user_context(cdk_own), ENV, base_image_resolver=lambda r, x: DLC).deployments


@pytest.mark.parametrize(
    "context, message",
    [
        ({"image_uri": "123.dkr.ecr.x/y:z", "image_tag": "v1"}, "image_uri and image_tag name two images"),
        ({"image_uri": "not an image"}, "image_uri: 'not an image' is not an image reference"),
    ],
)
def test_image_choice_is_one_valid_reference(context, message) -> None:
    with pytest.raises(TrainstackError, match=f"^cdk context: {message}"):
        load(recipe="30b-fp8", **context)
