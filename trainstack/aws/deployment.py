"""CDK context -> one frozen, validated DeploymentConfig. Read once, in app.py; constructs get typed values.

    -c recipe=NAME | all      a recipe (base or team variant); `all` = every base recipe, and every recipe
                              of every team (of `-c team` only, when given): what pipelines validate
    -c team=T                 layer recipes/teams/T/ onto the recipe
    -c set=k=v,k2=v2          overrides, as `trainstack ... --set` (values may not contain `,k=`)
    -c image_uri=URI          a prebuilt training image (else recipe image.uri, else built from
                              training_image/)
    -c image_tag=TAG          an image a pipeline pushed to this deployment's ECR repository
    -c vpc=true               run jobs in private subnets of a new VPC (EFA security group, endpoints)
    -c inter_container_encryption=true   encrypt traffic between nodes (costs step time; see docs/cdk.md)
    -c emulator=true          deploy into the local AWS emulator (trainstack.emulator); changes only what
                              the emulator cannot do, and says so. Implied when AWS_ENDPOINT_URL is localhost.
    -c pipeline=true          add the GitOps pipeline stack (stacks/pipeline.py)
    -c quiet=true             no warnings about values that are legal but almost surely wrong
                              (trainstack.planner.sanity; printed to stderr otherwise, never fatal)

A recipe that is invalid or does not fit stops here with one line, before any stack exists.

Without `-c recipe`, `cdk bootstrap` (and `cdk ls`, `cdk destroy`: commands that bundle no stack) still
work: app.py synthesizes only an empty placeholder stack then (see `bootstrap_only`); `cdk deploy` and
`cdk synth` without a recipe stop with one line saying how to pick one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from trainstack.aws import request_check
from trainstack.errors import RecipeError, TrainstackError
from trainstack.planner import budget, sanity
from trainstack.recipes import loader, naming
from trainstack.recipes.schema import Recipe

CONTEXT = "cdk context"
SET_CONTEXT = "-c set"  # how errors name the CDK app's overrides
CONTEXT_KEYS = (
    "recipe",
    "team",
    "set",
    "image_uri",
    "image_tag",
    "vpc",
    "inter_container_encryption",
    "emulator",
    "pipeline",
    "quiet",
    "connection_arn",
    "repository",
    "branch",
)  # the last three: stacks/pipeline.py
TRUE = {"true", "1", "yes", "on"}
FALSE = {"false", "0", "no", "off", ""}
ALL = "all"


@dataclass(frozen=True)
class ImageSource:
    """Where the training image comes from. Exactly one of uri / repository_tag / base_image_uri."""

    uri: str | None = None  # prebuilt, used as is
    repository_tag: str | None = None  # pushed to this deployment's ECR repository by a pipeline
    base_image_uri: str | None = None  # build training_image/ FROM this (a DockerImageAsset)

    @property
    def kind(self) -> str:
        return "uri" if self.uri else "repository" if self.repository_tag else "build"


@dataclass(frozen=True)
class Network:
    vpc: bool = False
    # Encrypting traffic between training nodes is an explicit choice: it slows collective-heavy
    # steps (AWS quotes "can increase training time"); EFA traffic inside the VPC stays private anyway.
    inter_container_encryption: bool = False
    network_isolation: bool = True  # only meaningful with vpc: the container gets no outbound network


@dataclass(frozen=True)
class Deployment:
    """One recipe as one team deploys it: two stacks, `<prefix>-Data` and `<prefix>-Launcher`."""

    recipe: Recipe
    team: str | None
    plan: Any  # trainstack.planner.Plan
    image: ImageSource
    files: tuple[str, ...] = ()
    warnings: tuple[
        str, ...
    ] = ()  # trainstack.planner.sanity lines: legal values that are almost surely wrong

    @property
    def stack_prefix(self) -> str:
        return naming.stack_prefix(self.recipe, self.team)

    @property
    def recipe_hash(self) -> str:
        return naming.recipe_hash(self.recipe)


@dataclass(frozen=True)
class DeploymentConfig:
    deployments: tuple[Deployment, ...]
    account: str | None
    region: str | None
    network: Network = field(default_factory=Network)
    emulator: bool = False
    pipeline: bool = False
    context: Mapping[str, str] = field(default_factory=dict)  # raw -c values, for the pipeline stack


def split_set(value: str) -> list[str]:
    """`a.b=1,c.d=x` -> ["a.b=1", "c.d=x"]; a comma splits only where the next `key=` begins."""
    value = value.strip()
    if not value:
        return []
    return [part.strip() for part in re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_.\-]*=)", value)]


def flag(context: Mapping[str, Any], key: str) -> bool:
    raw = context.get(key)
    if isinstance(raw, bool):
        return raw
    text = str(raw if raw is not None else "").strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise TrainstackError(f"{CONTEXT}: {key}: expected true or false, got {raw!r}")


def user_context(context: Mapping[str, Any]) -> dict[str, Any]:
    """The `-c` keys a user gave, without the CDK's own (`aws:cdk:...`, `@aws-cdk/...` feature flags,
    `<lookup>:account=...` cache entries)."""
    return {k: v for k, v in context.items() if v is not None and ":" not in k and not k.startswith("@")}


# The CDK CLI tells the app which stacks it will bundle assets for: `["**"]` (or the named stacks) for
# synth, deploy and diff, `[]` for bootstrap, ls and destroy. Absent: the app was run by hand.
BUNDLING_STACKS = "aws:cdk:bundling-stacks"
NO_RECIPE_HINT = (
    "pick one with `-c recipe=30b-fp8` (`trainstack recipes` lists them, `-c recipe=all` is every one)"
)


def bootstrap_only(context: Mapping[str, Any]) -> bool:
    """True when no recipe was given and the CLI runs a command that deploys nothing (bootstrap, ls,
    destroy). The CDK CLI (2.1148) reads the environment to bootstrap from the app's stacks and fails
    with "This app contains no stacks" on an app that has none, even for `cdk bootstrap aws://A/R`;
    so app.py then synthesizes one stack without resources, which nothing can deploy."""
    return not str(context.get("recipe") or "").strip() and context.get(BUNDLING_STACKS) == []


def _check_keys(context: Mapping[str, Any]) -> None:
    """A misspelt key (`-c tem=nlp`) would otherwise be ignored and deploy something else."""
    import difflib

    for key in user_context(context):
        if key not in CONTEXT_KEYS:
            close = difflib.get_close_matches(key, CONTEXT_KEYS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(CONTEXT_KEYS)}"
            raise TrainstackError(f"{CONTEXT}: {key}: unknown key ({hint})")


def load(
    context: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    recipes_dir: str | None = None,
    planner: Callable[[Recipe], Any] | None = None,
    base_image_resolver: Callable[[str, Recipe], str] | None = None,
) -> DeploymentConfig:
    """Validate every -c value and resolve the recipes; raises TrainstackError with one line."""
    _check_keys(context)
    name = str(context.get("recipe") or "").strip()
    if not name:
        raise TrainstackError(f"{CONTEXT}: recipe: required to synthesize or deploy: {NO_RECIPE_HINT}")
    team = str(context.get("team") or "").strip() or None
    overrides = split_set(str(context.get("set") or ""))
    # Emulator mode: asked for, or implied by an AWS endpoint on this machine (trainstack.emulator.endpoint).
    emulator = flag(context, "emulator") or env.get("AWS_ENDPOINT_URL", "").startswith(
        ("http://localhost", "http://127.0.0.1")
    )
    region = env.get("CDK_DEFAULT_REGION") or None
    plan_of = planner or _planner()
    resolve_base = base_image_resolver or resolve_base_image

    if name == ALL:
        pairs = _all_pairs(team, recipes_dir)
    else:
        pairs = [(name, team)]
        _check_selected(name, team, recipes_dir)
    deployments = []
    for recipe_name, recipe_team in pairs:
        resolved = loader.resolve(
            recipe_name, recipe_team, overrides, recipes_dir=recipes_dir, overrides_source=SET_CONTEXT
        )
        recipe = resolved.recipe
        plan = plan_of(recipe)
        if not plan.fits:
            reason = _reason(plan)
            if not reason.startswith("does not fit"):
                reason = f"does not fit: {reason}"
            raise RecipeError(resolved.files[-1] if resolved.files else recipe_name, None, reason)
        budget.enforce(resolved, plan)  # a team's caps on nodes and planned cost (trainstack.planner.budget)
        request_check.enforce(resolved)  # every request AWS would refuse (trainstack.aws.request_check)
        image = _image_source(context, recipe, emulator, _target(recipe, emulator)[1] or region, resolve_base)
        label = f"{recipe_name} --team {recipe_team}" if recipe_team else recipe_name
        concerns = tuple(sanity.lines(resolved, plan, label))
        deployments.append(Deployment(recipe, recipe_team, plan, image, resolved.files, concerns))
    _check_unique(deployments)
    # A team's defaults may name where its stacks go (recipe `deploy`); used when every recipe agrees.
    targets = {_target(d.recipe, emulator) for d in deployments}
    account, team_region = targets.pop() if len(targets) == 1 else (None, None)
    return DeploymentConfig(
        deployments=tuple(deployments),
        account=account or env.get("CDK_DEFAULT_ACCOUNT") or None,
        region=team_region or region,
        network=Network(
            vpc=flag(context, "vpc"),
            inter_container_encryption=flag(context, "inter_container_encryption"),
        ),
        emulator=emulator,
        pipeline=flag(context, "pipeline"),
        context={k: str(v) for k, v in context.items() if isinstance(v, str | bool | int)},
    )


def _target(recipe: Recipe, emulator: bool) -> tuple[str | None, str | None]:
    """(account, region) from the recipe's `deploy` section; EMULATOR: ignored, the emulator is local."""
    return (None, None) if emulator else (recipe.deploy.account, recipe.deploy.region)


def _all_pairs(team: str | None, recipes_dir: str | None) -> list[tuple[str, str | None]]:
    if team is not None:
        return [(n, team) for n in loader.team_recipe_names(team, recipes_dir)]
    pairs: list[tuple[str, str | None]] = [(n, None) for n in loader.base_recipe_names(recipes_dir)]
    for each in loader.team_names(recipes_dir):
        pairs += [(n, each) for n in loader.team_recipe_names(each, recipes_dir)]
    return pairs


def _check_selected(name: str, team: str | None, recipes_dir: str | None) -> None:
    """A team deploys only the base recipes its defaults select (`recipes:`; default every one)."""
    if (
        team is None
        or name not in loader.base_recipe_names(recipes_dir)
        or not loader.team_names(recipes_dir)
    ):
        return
    if team not in loader.team_names(recipes_dir):
        return  # the loader names the unknown team
    selected = loader.team_selection(team, recipes_dir)
    if selected is not None and name not in selected:
        defaults = Path(loader.recipes_dir_or_default(recipes_dir)) / "teams" / team / loader.TEAM_DEFAULTS
        raise RecipeError(
            loader.display_path(defaults),
            loader.TEAM_RECIPES_KEY,
            f"team {team} does not deploy {name} (it selects {', '.join(selected)}): add {name} to "
            f"`{loader.TEAM_RECIPES_KEY}:` to deploy it",
        )


def _check_unique(deployments: list[Deployment]) -> None:
    seen: dict[str, Deployment] = {}
    for d in deployments:
        if d.stack_prefix in seen:
            raise TrainstackError(f"{CONTEXT}: two recipes map to the stack prefix {d.stack_prefix}")
        seen[d.stack_prefix] = d


def _reason(plan: Any) -> str:
    for attr in ("verdict", "reason", "summary"):
        text = getattr(plan, attr, None)
        if isinstance(text, str) and text:
            return text.splitlines()[0]
    memory = plan.memory
    return f"peak memory {memory.peak_gib:.1f} GiB per GPU exceeds the usable {memory.usable_gib:.1f} GiB"


def _image_source(
    context: Mapping[str, Any],
    recipe: Recipe,
    emulator: bool,
    region: str | None,
    resolve_base: Callable[[str, Recipe], str],
) -> ImageSource:
    given_uri, given_tag = (str(context.get(k) or "").strip() for k in ("image_uri", "image_tag"))
    if given_uri and given_tag:
        raise TrainstackError(f"{CONTEXT}: image_uri and image_tag name two images: pass only one")
    if given_uri and not re.fullmatch(r"[^\s/]+(/[^\s/]+)+|[^\s/:@]+([:@][^\s]+)?", given_uri):
        raise TrainstackError(
            f"{CONTEXT}: image_uri: {given_uri!r} is not an image reference "
            "(e.g. 123456789012.dkr.ecr.us-west-2.amazonaws.com/trainstack:v1)"
        )
    uri = given_uri or recipe.image.uri
    if uri:
        return ImageSource(uri=uri)
    tag = str(context.get("image_tag") or "").strip()
    if tag:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}", tag):
            raise TrainstackError(f"{CONTEXT}: image_tag: {tag!r} is not a valid image tag")
        return ImageSource(repository_tag=tag)
    if emulator:
        # EMULATOR: no Docker engine runs here, so nothing can be built; reference the tag a pipeline
        # would push for this recipe. The emulator never pulls it (its jobs do not run containers).
        return ImageSource(repository_tag=naming.recipe_hash(recipe))
    if region is None:
        raise TrainstackError(
            f"{CONTEXT}: building the training image needs a region to pick the base image "
            "(set AWS_REGION / a profile region, or pass -c image_uri=... or -c image_tag=...)"
        )
    return ImageSource(base_image_uri=resolve_base(region, recipe))


@lru_cache(maxsize=32)
def _retrieve(region: str, version: str, instance_type: str) -> str:
    # Imported here: sagemaker.core takes ~2 s to import and only the build path needs it.
    from sagemaker.core import image_uris

    return image_uris.retrieve(
        framework="pytorch",
        region=region,
        version=version,
        py_version="py312",
        instance_type=instance_type,
        image_scope="training",
    )


BASE_IMAGE_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "base-images.json"


def resolve_base_image(region: str, recipe: Recipe, cache: Path | None = BASE_IMAGE_CACHE) -> str:
    """The AWS Deep Learning Container PyTorch training image for the recipe's version and region.

    Answers are cached per sagemaker-core version (importing it costs ~1.5 s of every synthesis; the
    answer only changes when the SDK's bundled image table does).
    """
    from importlib.metadata import version

    key = "|".join(
        (
            region,
            recipe.image.framework_version,
            recipe.compute.instance_type,
            f"sagemaker-core=={version('sagemaker-core')}",
        )
    )
    known = _read_cache(cache)
    if key in known:
        return known[key]
    try:
        uri = _retrieve(region, recipe.image.framework_version, recipe.compute.instance_type)
    except ValueError as exc:
        raise RecipeError("recipe", "image.framework_version", str(exc).splitlines()[0]) from None
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({**_read_cache(cache), key: uri}, indent=1, sort_keys=True))
        except OSError:
            pass  # a read-only checkout just resolves every time
    return uri


def _read_cache(cache: Path | None) -> dict[str, str]:
    try:
        data = json.loads(cache.read_text()) if cache is not None else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _planner() -> Callable[[Recipe], Any]:
    from trainstack import planner

    if not hasattr(planner, "plan"):
        raise TrainstackError("trainstack.planner.plan is not available yet (issue 2)")
    return planner.plan
