"""Every CreateTrainingJob request the project can make, checked as SageMaker would check it, before deploy.

botocore's `ParamValidator` (what boto3 runs client-side, and all the local emulator checks) looks at
member names, types and required members only. SageMaker also enforces everything its service model
declares (string, list and map lengths, numeric ranges, patterns, enum values) and rules the model cannot
express. This module checks both, with no AWS call:

- `check_request(request)`: one request. botocore's `ParamValidator`, then every member against its
  shape in botocore's own SageMaker model (min/max, pattern, enum), then SageMaker's documented
  cross-field rules (`_cross_field`, each citing its source). Keys ending in `.$` are Step Functions
  run-time values (trainstack.aws.request.Runtime) and cannot be checked there; `check_recipe` covers them.
- `check_recipe(recipe, team)`: every request the project builds for a recipe: the launcher's request
  (run-time values included), and the concrete requests of each launch option (a run with the longest
  job name the launcher can produce, a short tuning run on a warm pool, VPC mode). Each finding names
  the recipe field that caused it.
- `enforce(resolved)`: what `trainstack validate`, `trainstack plan` and `cdk synth` call next to the
  budget guard; the first finding becomes one RecipeError line naming the file and field (exit 2).

AWS patterns are Java regular expressions matched against the whole value; `java_pattern` translates
what Python's `re` reads differently (Unicode `\\p{..}` classes, ASCII-only `\\d \\w \\s`).
"""

from __future__ import annotations

import re
import sys
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

from trainstack.errors import RecipeError
from trainstack.recipes import naming
from trainstack.recipes.hardware import INSTANCES, volume_size_problem
from trainstack.recipes.schema import SOURCE_CHANNEL_PREFIX

if TYPE_CHECKING:
    from botocore.model import Shape

    from trainstack.recipes.loader import ResolvedRecipe
    from trainstack.recipes.schema import Recipe

OPERATION = "CreateTrainingJob"
RUNTIME_SUFFIX = ".$"  # Step Functions: the value is a path or intrinsic function, resolved at run time
# "The maximum value is 28 days." (SageMaker API reference, StoppingCondition.MaxRuntimeInSeconds; the
# model itself declares only a minimum of 1.)
MAX_RUNTIME_SECONDS = 28 * 24 * 3600
# The aws: prefix of tag keys is reserved for AWS use, in any case ("Tagging AWS resources", tag naming
# limits and requirements); SageMaker and CloudFormation refuse such a key.
RESERVED_TAG_PREFIX = "aws:"

# Placeholders for what only a deployment knows, each as long as a real one can be and valid for its
# member's pattern, so a finding is always about what the recipe decides.
PLACEHOLDER_ACCOUNT = "123456789012"
PLACEHOLDER_REGION = "ap-southeast-4"  # among the longest region names
PLACEHOLDERS = dict(
    role_arn=f"arn:aws:iam::{PLACEHOLDER_ACCOUNT}:role/Trainstack-team-recipe-Launcher-ExecutionRole829ADBFF-A1B2C3D4E5F6",
    # A CDK DockerImageAsset repository and 64-hex-digit tag: the longest image reference a deploy makes.
    image_uri=(
        f"{PLACEHOLDER_ACCOUNT}.dkr.ecr.{PLACEHOLDER_REGION}.amazonaws.com/"
        f"cdk-hnb659fds-container-assets-{PLACEHOLDER_ACCOUNT}-{PLACEHOLDER_REGION}:{'f' * 64}"
    ),
    bucket_name="trainstack-team-recipe-d-checkpointsbucket6ba0c50d-a1b2c3d4e5f6",  # 63: S3's longest
    kms_key_arn=f"arn:aws:kms:{PLACEHOLDER_REGION}:{PLACEHOLDER_ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab",
    # A team's managed MLflow App (tracking.mlflow: managed; used only by recipes that track).
    mlflow_arn=f"arn:aws:sagemaker:{PLACEHOLDER_REGION}:{PLACEHOLDER_ACCOUNT}:mlflow-app/app-{'a' * 12}",
)
PLACEHOLDER_VPC = dict(
    subnet_ids=["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
    security_group_ids=["sg-0123456789abcdef0"],
    network_isolation=True,
    inter_container_encryption=True,
)


@dataclass(frozen=True)
class Finding:
    path: str  # where in the request: "ResourceConfig.VolumeKmsKeyId", "Tags[3].Key", "HyperParameters[a.b]"
    message: str
    field: str | None = None  # the recipe field that decides it (check_recipe), e.g. "compute.spot"

    def __str__(self) -> str:
        return f"{self.field or self.path}: {self.message}"


# --- one request -------------------------------------------------------------------------------


def check_request(request: Mapping[str, Any]) -> list[Finding]:
    """Everything SageMaker would refuse in this CreateTrainingJob request (run-time `.$` values aside)."""
    return check_against_model("sagemaker", OPERATION, request) + _cross_field(request)


def check_against_model(service: str, operation: str, params: Mapping[str, Any]) -> list[Finding]:
    """`params` of any AWS API call against botocore's model of it: `ParamValidator`, then every
    member's min/max, pattern and enum (what the service enforces and the emulator does not)."""
    shape = _input_shape(service, operation)
    owner = SERVICE_NAMES.get(service, service)
    return _param_validator(params, shape, operation) + _constraints(params, shape, "", owner)


SERVICE_NAMES = {
    "sagemaker": "SageMaker",
    "cloudwatch": "CloudWatch",
    "stepfunctions": "Step Functions",
    "scheduler": "EventBridge Scheduler",
}


@lru_cache(maxsize=8)
def _input_shape(service: str, operation: str) -> Shape:
    import botocore.session

    return botocore.session.get_session().get_service_model(service).operation_model(operation).input_shape


def _param_validator(request: Mapping[str, Any], shape: Shape, operation: str) -> list[Finding]:
    """botocore's own check: unknown members, types, required members (run-time values as placeholders).

    Its minimum lengths and values are left to `_constraints`, which checks both ends of every range.
    """
    from botocore.validate import ParamValidator

    report = ParamValidator().validate(_with_placeholders(request, shape), shape)
    if not report.has_errors():
        return []
    return [
        Finding(operation, line.split(", must be one of:")[0])
        for line in report.generate_report().splitlines()
        if line.strip() and not line.startswith(("Invalid length", "Invalid range"))
    ]


def _with_placeholders(value: Any, shape: Shape | None) -> Any:
    if shape is not None and shape.type_name == "map" and isinstance(value, Mapping):
        # A map entry filled in at run time (`"TRAINSTACK_RUN.$": "$.Run"` in Environment): its key is
        # known, its value is not.
        return {
            key.removesuffix(RUNTIME_SUFFIX): (
                _PLACEHOLDER_OF_TYPE.get(shape.value.type_name, "runtime")
                if key.endswith(RUNTIME_SUFFIX)
                else _with_placeholders(member_value, shape.value)
            )
            for key, member_value in value.items()
        }
    if shape is None or shape.type_name != "structure" or not isinstance(value, Mapping):
        if shape is not None and shape.type_name == "list" and isinstance(value, list):
            return [_with_placeholders(v, shape.member) for v in value]
        return value
    out: dict[str, Any] = {}
    for key, member_value in value.items():
        name = key.removesuffix(RUNTIME_SUFFIX)
        member = shape.members.get(name)
        if key.endswith(RUNTIME_SUFFIX) and member is not None:
            out[name] = _PLACEHOLDER_OF_TYPE.get(member.type_name, "runtime")
        else:
            out[key] = _with_placeholders(member_value, member)
    return out


_PLACEHOLDER_OF_TYPE: dict[str, Any] = {
    "string": "runtime",
    "integer": 0,
    "long": 0,
    "boolean": False,
    "map": {},
    "list": [],
    "structure": {},
}


def _constraints(value: Any, shape: Shape, path: str, owner: str) -> list[Finding]:
    """Every member against its shape's min/max, pattern and enum (what ParamValidator leaves out)."""
    found: list[Finding] = []
    kind = shape.type_name
    meta = shape.metadata
    if kind == "structure":
        if isinstance(value, Mapping):
            for key, member_value in value.items():
                member = shape.members.get(key)
                if member is not None:  # unknown and run-time keys: ParamValidator / check_recipe
                    found += _constraints(member_value, member, _join(path, key), owner)
        return found
    if kind in ("list", "map") and isinstance(value, list | Mapping):
        found += _length(path, len(value), meta, "items" if kind == "list" else "entries", owner)
        if kind == "list":
            for i, item in enumerate(value):
                found += _constraints(item, shape.member, f"{path}[{i}]", owner)
        else:
            for key, item in value.items():
                name = key.removesuffix(RUNTIME_SUFFIX)  # a run-time entry: its key is known, not its value
                found += _constraints(name, shape.key, f"{path}[{name}] key", owner)
                if not key.endswith(RUNTIME_SUFFIX):
                    found += _constraints(item, shape.value, f"{path}[{name}]", owner)
        return found
    if kind == "string" and isinstance(value, str):
        found += _length(path, len(value), meta, "characters", owner)
        if "enum" in meta and value not in meta["enum"]:
            found.append(
                Finding(path, f"{value!r} is not one of the {len(meta['enum'])} values {owner} accepts")
            )
        if "pattern" in meta and not java_pattern(meta["pattern"]).fullmatch(value):
            found.append(Finding(path, f"{_shown(value)} does not match {owner}'s pattern {meta['pattern']}"))
        return found
    if (
        kind in ("integer", "long", "float", "double")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    ):
        if "min" in meta and value < meta["min"]:
            found.append(Finding(path, f"{value:,} is below {owner}'s minimum of {meta['min']:,}"))
        if "max" in meta and value > meta["max"]:
            found.append(Finding(path, f"{value:,} is above {owner}'s maximum of {meta['max']:,}"))
    return found


def _length(path: str, length: int, meta: Mapping[str, Any], unit: str, owner: str) -> list[Finding]:
    if "min" in meta and length < meta["min"]:
        return [Finding(path, f"{length:,} {unit}, fewer than {owner}'s minimum of {meta['min']:,}")]
    if "max" in meta and length > meta["max"]:
        return [Finding(path, f"{length:,} {unit}, more than {owner}'s maximum of {meta['max']:,}")]
    return []


def _cross_field(request: Mapping[str, Any]) -> list[Finding]:
    """SageMaker's documented rules that span members (the service model cannot state them)."""
    found: list[Finding] = []
    resources = request.get("ResourceConfig") or {}
    stopping = request.get("StoppingCondition") or {}
    spot = request.get("EnableManagedSpotTraining") is True

    # Local NVMe storage: "You can't request a VolumeKmsKeyId when using an instance type with local
    # storage"; "You can't request a VolumeSizeInGB greater than the total size of the local instance
    # storage" (API reference, ResourceConfig; the catalog knows which types have it).
    instance = INSTANCES.get(resources.get("InstanceType", ""))
    if instance is not None and instance.has_instance_store:
        if "VolumeKmsKeyId" in resources or f"VolumeKmsKeyId{RUNTIME_SUFFIX}" in resources:
            found.append(
                Finding(
                    "ResourceConfig.VolumeKmsKeyId",
                    f"SageMaker refuses a VolumeKmsKeyId on {instance.instance_type}: its "
                    f"{instance.instance_store_gb:,} GB of local NVMe storage is encrypted by the instance's "
                    "hardware module, and no EBS volume is attached",
                )
            )
        size = resources.get("VolumeSizeInGB")
        if isinstance(size, int) and (problem := volume_size_problem(instance, size)) is not None:
            found.append(Finding("ResourceConfig.VolumeSizeInGB", problem))

    # "SageMaker Managed Warm Pools cannot be used with spot instances." (developer guide, warm pools,
    # Considerations). A run-time value could be a warm pool, so it is refused with spot as well.
    keep_alive = resources.get("KeepAlivePeriodInSeconds")
    if spot and (f"KeepAlivePeriodInSeconds{RUNTIME_SUFFIX}" in resources or (keep_alive or 0) > 0):
        found.append(
            Finding(
                "ResourceConfig.KeepAlivePeriodInSeconds",
                "SageMaker warm pools cannot be used with managed spot training",
            )
        )
    # Training plans (ResourceConfig.TrainingPlanArn): the plan's pages (training-plan utilization,
    # "Create a training job using the API, CLI, SageMaker SDK", reserve capacity with training plans) and
    # the API reference state that the plan must be Scheduled or Active, that InstanceType must match the
    # plan's and that a job uses exactly one plan; they say nothing of managed spot or warm pools, so no
    # rule is invented here. The ARN itself is checked against the model's pattern and minimum length.

    runtime, wait = stopping.get("MaxRuntimeInSeconds"), stopping.get("MaxWaitTimeInSeconds")
    if isinstance(runtime, int) and runtime > MAX_RUNTIME_SECONDS:
        found.append(
            Finding(
                "StoppingCondition.MaxRuntimeInSeconds",
                f"{runtime:,} s is more than SageMaker's maximum of 28 days ({MAX_RUNTIME_SECONDS:,} s)",
            )
        )
    if wait is not None and not spot:
        # Refused with "Invalid MaxWaitTimeInSeconds. It is only supported when EnableManagedSpotTraining
        # is set to true" (the ValidationException SageMaker returns; the member is "the maximum length of
        # time ... that a managed Spot training job has to complete").
        found.append(
            Finding("StoppingCondition.MaxWaitTimeInSeconds", "only allowed with managed spot training")
        )
    if isinstance(runtime, int) and isinstance(wait, int) and wait < runtime:
        # "It must be equal to or greater than MaxRuntimeInSeconds." (API reference, StoppingCondition)
        found.append(
            Finding(
                "StoppingCondition.MaxWaitTimeInSeconds",
                f"{wait:,} s is less than MaxRuntimeInSeconds ({runtime:,} s); SageMaker requires "
                "MaxWait >= MaxRuntime",
            )
        )

    tags = request.get("Tags")
    if isinstance(tags, list):
        seen: set[str] = set()
        for i, tag in enumerate(tags):
            key = tag.get("Key") if isinstance(tag, Mapping) else None
            if not isinstance(key, str):
                continue
            if key.lower().startswith(RESERVED_TAG_PREFIX):
                found.append(
                    Finding(f"Tags[{i}].Key", f"{key!r}: the aws: prefix is reserved for AWS's own tags")
                )
            if key in seen:  # "Tag keys must be unique per resource." (API reference, Tag)
                found.append(Finding(f"Tags[{i}].Key", f"{key!r} appears twice; tag keys must be unique"))
            seen.add(key)
    return found


# --- every request of a recipe -----------------------------------------------------------------


def longest_run_id() -> str:
    """A run id of the greatest length trainstack.recipes.naming allows (a `--name` or the default id)."""
    return "z" * naming.RUN_ID_MAX


def longest_job_name(recipe: Recipe, team: str | None) -> str:
    """The longest training job name the supervisor can give this recipe's jobs (trainstack.recipes.naming):
    `<prefix><run id>-<job index>` with the longest run id and the last job a run may have, so the
    check fails as soon as the arithmetic there does."""
    return naming.job_of_run(naming.run_name(recipe, team, longest_run_id()), naming.JOB_INDEX_MAX)


def requests_for(recipe: Recipe, team: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(what, request) for every CreateTrainingJob request the project can make for `recipe` as `team`."""
    from trainstack.aws.request import (
        INPUT_KEEP_ALIVE,
        WARM_POOL_SECONDS,
        Runtime,
        checkpoint_uri,
        create_training_job_request,
    )
    from trainstack.aws.tracking import PREVIOUS_JOB_END_MAX
    from trainstack.recipes.schema import to_hyperparameters

    name = longest_job_name(recipe, team)
    run = naming.run_name(recipe, team, longest_run_id())
    deployment = {**PLACEHOLDERS, "image_uri": recipe.image.uri or PLACEHOLDERS["image_uri"]}
    run_values = dict(
        run=run, checkpoint_uri=checkpoint_uri(deployment["bucket_name"], recipe, team, longest_run_id())
    )
    for vpc, network in (("", {}), (" in VPC mode", PLACEHOLDER_VPC)):
        # The supervisor's request, as stacks/launcher_stack.py builds it: run-time values stay `.$`
        # expressions (which ones does not matter here: they cannot be checked before run time).
        yield (
            f"the supervisor's request{vpc}",
            create_training_job_request(
                recipe,
                team,
                job_name=Runtime("$.Names.JobName"),
                run=Runtime("$.Run"),
                checkpoint_uri=Runtime("$.Names.CheckpointUri"),
                hyperparameters=Runtime("$.HyperParameters"),
                keep_alive_seconds=Runtime(f"$.{INPUT_KEEP_ALIVE}"),
                **deployment,
                **network,
            ),
        )
        # What it sends at run time: the longest job name, the recipe's hyperparameters, and the warm
        # pool of a plain launch and of a short tuning run (`trainstack launch --max-steps`).
        for keep_alive in sorted(
            {recipe.compute.keep_alive_seconds, max(WARM_POOL_SECONDS, recipe.compute.keep_alive_seconds)}
        ):
            yield (
                f"a job named {name}{vpc} with a {keep_alive} s warm pool",
                create_training_job_request(
                    recipe,
                    team,
                    job_name=name,
                    **run_values,
                    hyperparameters=to_hyperparameters(recipe),
                    keep_alive_seconds=keep_alive,
                    previous_job_end="p" * PREVIOUS_JOB_END_MAX,  # the longest the CLI sends
                    **deployment,
                    **network,
                ),
            )


def check_recipe(recipe: Recipe, team: str | None) -> list[Finding]:
    """Every distinct finding over every request `requests_for` yields, each naming its recipe field."""
    findings: dict[tuple[str, str], Finding] = {}
    compute = recipe.compute
    if compute.spot and compute.keep_alive_seconds > 0:
        # The request builder leaves the warm pool out of spot requests (it cannot be honoured), so the
        # recipe that asks for both is told here rather than silently getting no warm pool.
        finding = Finding(
            "ResourceConfig.KeepAlivePeriodInSeconds",
            f"{compute.keep_alive_seconds}: SageMaker warm pools cannot be used with managed spot training "
            "(compute.spot is true); set keep_alive_seconds: 0 or spot: false",
            "compute.keep_alive_seconds",
        )
        findings[(finding.path, finding.message)] = finding
    for _what, request in requests_for(recipe, team):
        for finding in check_request(request):
            key = (finding.path, finding.message)
            if key not in findings:
                findings[key] = replace(finding, field=recipe_field(finding.path, request))
    return list(findings.values())


def enforce(resolved: ResolvedRecipe) -> list[Finding]:
    """`check_recipe`, raising one RecipeError line for the first finding (file and recipe field)."""
    findings = check_recipe(resolved.recipe, resolved.team)
    if findings:
        first = findings[0]
        raise RecipeError(
            _source(resolved, first.field), first.field, f"{first.message} [{OPERATION} {first.path}]"
        )
    return findings


# Request member -> the recipe field that decides it; the longest matching prefix wins.
_FIELDS: tuple[tuple[str, str], ...] = (
    ("TrainingJobName", "name"),
    ("ResourceConfig.InstanceType", "compute.instance_type"),
    ("ResourceConfig.InstanceCount", "compute.instance_count"),
    ("ResourceConfig.VolumeSizeInGB", "compute.volume_size_gb"),
    ("ResourceConfig.VolumeKmsKeyId", "compute.instance_type"),
    ("ResourceConfig.KeepAlivePeriodInSeconds", "compute.keep_alive_seconds"),
    ("ResourceConfig.TrainingPlanArn", "compute.training_plan_arn"),
    ("StoppingCondition.MaxRuntimeInSeconds", "compute.max_runtime_hours"),
    ("StoppingCondition.MaxWaitTimeInSeconds", "compute.max_wait_hours"),
    ("EnableManagedSpotTraining", "compute.spot"),
    ("RetryStrategy", "compute.max_retry_attempts"),
    ("AlgorithmSpecification.TrainingImage", "image.uri"),
    ("InputDataConfig", "data.train_s3_uri"),
    ("CheckpointConfig", "name"),
    ("OutputDataConfig.S3OutputPath", "name"),
    ("Environment[TRAINSTACK_RECIPE]", "name"),
    ("Environment[MLFLOW_EXPERIMENT_NAME]", "tracking.experiment"),
    ("Environment[MLFLOW_TRACKING_URI]", "tracking.mlflow"),
    ("MlflowConfig", "tracking.mlflow"),
    ("MlflowConfig.MlflowExperimentName", "tracking.experiment"),
    ("TensorBoardOutputConfig", "tracking.tensorboard"),
    ("Tags", "tags.extra"),
)
# trainstack's own tags (trainstack.aws.request.tags) -> the recipe field each comes from.
_OWN_TAG_FIELDS = {"team": "tags.team", "recipe": "name", "cost-center": "tags.cost_center"}


def recipe_field(path: str, request: Mapping[str, Any]) -> str | None:
    """The recipe field behind a request member, or None where the project, not the recipe, decides it."""
    if tag := re.match(r"^Tags\[(\d+)\]", path):
        tags = request.get("Tags") or []
        index = int(tag.group(1))
        key = tags[index].get("Key") if index < len(tags) and isinstance(tags[index], Mapping) else None
        if key == naming.PROJECT or key is None:
            return None if key is not None else "tags.extra"
        return _OWN_TAG_FIELDS.get(key, f"tags.extra.{key}")
    if channel := re.match(r"^InputDataConfig\[(\d+)\]", path):
        configs = request.get("InputDataConfig") or []
        index = int(channel.group(1))
        config = configs[index] if index < len(configs) and isinstance(configs[index], Mapping) else {}
        if str(config.get("ChannelName", "")).startswith(SOURCE_CHANNEL_PREFIX):
            return f"data.sources.{index}.uri"  # a blend source's channel (trainstack.planner.input_mode)
    if hyper := re.match(r"^HyperParameters\[([^\]]+)\]", path):
        return hyper.group(1)  # the encoding's keys are the recipe's own dotted field paths
    best: tuple[int, str | None] = (0, None)
    for prefix, field in _FIELDS:
        if (path == prefix or path.startswith((prefix + ".", prefix + "["))) and len(prefix) > best[0]:
            best = (len(prefix), field)
    return best[1]


def _source(resolved: ResolvedRecipe, field: str | None) -> str:
    """The file that wrote `field` (or its nearest parent), else the recipe's most specific file."""
    parts = field.split(".") if field else []
    while parts:
        if (source := resolved.sources.get(".".join(parts))) is not None:
            return source
        parts.pop()
    return resolved.files[-1] if resolved.files else resolved.recipe.name


# --- Java patterns in Python -------------------------------------------------------------------


@cache
def java_pattern(pattern: str) -> re.Pattern[str]:
    """`pattern` (a Java regular expression from an AWS model) as a Python one with Java's meaning.

    Java's `\\d \\w \\s` are ASCII-only by default (so re.ASCII); `\\p{L}`-style Unicode categories and
    POSIX classes such as `\\p{Alnum}` become explicit character classes; `\\z` is Python's `\\Z`. Java
    syntax with no translation here (class intersections `&&`, nested classes, `\\P` inside a class)
    raises ValueError rather than silently matching something else.
    """
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in "pP" and i + 2 < len(pattern):
                name, end = _property_name(pattern, i + 2)
                body = _property_class(name)
                if nxt == "P":
                    if in_class:
                        raise ValueError(f"{pattern!r}: \\P inside a character class is not translated")
                    out.append(f"[^{body}]")
                else:
                    out.append(body if in_class else f"[{body}]")
                i = end
                continue
            if nxt == "z" and not in_class:
                out.append(r"\Z")
            elif nxt == "Z" and not in_class:
                out.append(r"(?=\n?\Z)")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            if char == "[" or pattern.startswith("&&", i):
                raise ValueError(f"{pattern!r}: nested classes and intersections are not translated")
            if char == "]":
                in_class = False
        elif char == "[":
            in_class = True
            out.append(char)
            i += 1
            if i < len(pattern) and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < len(pattern) and pattern[i] == "]":  # a literal ] first in a class
                out.append(r"\]")
                i += 1
            continue
        out.append(char)
        i += 1
    return re.compile("".join(out), re.ASCII)


def _property_name(pattern: str, start: int) -> tuple[str, int]:
    if pattern[start] == "{":
        end = pattern.index("}", start)
        return pattern[start + 1 : end], end + 1
    return pattern[start], start + 1  # \pL


# Java's POSIX classes (US-ASCII unless UNICODE_CHARACTER_CLASS, which AWS models do not set).
_POSIX = {
    "Lower": "a-z",
    "Upper": "A-Z",
    "ASCII": r"\x00-\x7f",
    "Alpha": "a-zA-Z",
    "Digit": "0-9",
    "Alnum": "a-zA-Z0-9",
    "Punct": r"!-/:-@\[-`{-~",
    "Graph": r"!-~",
    "Print": r" -~",
    "Blank": r" \t",
    "Cntrl": r"\x00-\x1f\x7f",
    "XDigit": "0-9a-fA-F",
    "Space": r" \t\n\x0b\f\r",
}


def _property_class(name: str) -> str:
    """The body of a character class for `\\p{name}`: a POSIX class or a Unicode general category."""
    if name in _POSIX:
        return _POSIX[name]
    category = name.removeprefix("Is").removeprefix("general_category=").removeprefix("gc=")
    if not re.fullmatch(r"[A-Z][a-z]?", category):
        raise ValueError(f"\\p{{{name}}} is not a class this translation knows")
    return _category_ranges(category)


@cache
def _category_ranges(category: str) -> str:
    """Every code point whose Unicode general category is or starts with `category`, as class ranges."""
    spans = sorted(
        span for name, found in _category_spans().items() if name.startswith(category) for span in found
    )
    if not spans:
        raise ValueError(f"no code point has the Unicode category {category!r}")
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start == merged[-1][1] + 1:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in merged)


@cache
def _category_spans() -> dict[str, list[tuple[int, int]]]:
    """Unicode general category -> its runs of code points (one pass over all of Unicode, ~0.1 s)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    category, start = unicodedata.category("\0"), 0
    for code in range(1, sys.maxunicode + 1):
        here = unicodedata.category(chr(code))
        if here != category:
            spans.setdefault(category, []).append((start, code - 1))
            category, start = here, code
    spans.setdefault(category, []).append((start, sys.maxunicode))
    return spans


def all_patterns(shape: Shape | None = None, seen: set[str] | None = None) -> Iterator[tuple[str, str]]:
    """(shape name, pattern) for every pattern in the CreateTrainingJob input, nested shapes included."""
    shape = shape or _input_shape("sagemaker", OPERATION)
    seen = set() if seen is None else seen
    if shape.name in seen:
        return
    seen.add(shape.name)
    if "pattern" in shape.metadata:
        yield shape.name, shape.metadata["pattern"]
    children: Sequence[Shape] = ()
    if shape.type_name == "structure":
        children = list(shape.members.values())
    elif shape.type_name == "list":
        children = [shape.member]
    elif shape.type_name == "map":
        children = [shape.key, shape.value]
    for child in children:
        yield from all_patterns(child, seen)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 80 else repr(value[:77] + "...")
