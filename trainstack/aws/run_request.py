"""A run's own CreateTrainingJob request: recorded at launch, the template of every job of the run.

A run trains what it was launched with. StartJob builds the request from the deployed recipe once, at
launch, and the run registry keeps it (attribute `request`, without `TrainingJobName`); every later job
of the run, the supervisor's and `resume`'s, is that request with the job's own name, whatever was
deployed since. A deliberate change (`trainstack resume RUN --set key=value`) changes the recorded
request exactly where the recipe change changes the request the builder makes (`changed_request`), so
fields others add to the builder (and the deployed values: role, image, bucket, key, network) stay as
recorded. Pure: no AWS here.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from trainstack.aws import request as builder
from trainstack.errors import RecipeError, TrainstackError
from trainstack.recipes import changes as recipe_changes
from trainstack.recipes import overrides as override_rules
from trainstack.recipes.schema import Recipe, from_hyperparameters

SET_SOURCE = "--set"
JOB_NAME = "TrainingJobName"


def recipe_of(request: Mapping[str, Any]) -> Recipe:
    """The resolved recipe a request trains: its hyperparameters are the recipe's one encoding."""
    return from_hyperparameters(dict(request["HyperParameters"]))


def job_request(request: Mapping[str, Any], job_name: str, job_environment: Mapping[str, str]) -> dict:
    """What CreateTrainingJob receives for one job of the run: the recorded request, the job's name, and
    the job's own environment on top (the StartJob state does the same in JSONata)."""
    sent = copy.deepcopy(dict(request))
    sent[JOB_NAME] = job_name
    sent["Environment"] = {**sent.get("Environment", {}), **job_environment}
    return sent


def size_bytes(request: Mapping[str, Any]) -> int:
    """The request as the registry stores it (compact JSON text, UTF-8)."""
    return len(json.dumps(request, separators=(",", ":")).encode())


# --- Deliberate changes ---------------------------------------------------------------------------


def safe_set_keys(assignments: Iterable[str]) -> list[str]:
    """The dotted keys of `--set key=value` assignments; a key that may not change between two jobs of a
    run (trainstack.recipes.changes) is refused in one line, before anything is read."""
    keys = []
    for assignment in assignments:
        key, sep, _ = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(SET_SOURCE, None, f"{assignment!r} is not key.path=value")
        if not recipe_changes.is_safe(key):
            raise RecipeError(
                override_rules.override_label(SET_SOURCE, assignment),
                key,
                "cannot change in a running run: the run's checkpoints were written with it (the model's "
                "shape, sequence length, global batch, seed, precision and data are fixed; launch a new "
                "run for those)",
            )
        keys.append(key)
    return keys


def apply_sets(recipe: Recipe, assignments: Iterable[str]) -> Recipe:
    """`recipe` with `--set` assignments applied and validated; an invalid value is one line naming the
    override as typed."""
    assignments = list(assignments)
    safe_set_keys(assignments)
    tree, typed = override_rules.parse(assignments, SET_SOURCE)
    data = recipe.model_dump(mode="json", exclude={"extends"})
    _merge(data, tree)
    try:
        changed = Recipe.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        label = next((a for k, a in typed if path and (k == path or path.startswith(k + "."))), None)
        source = override_rules.override_label(SET_SOURCE, label or " ".join(assignments))
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        raise RecipeError(source, path or None, message) from None
    unsafe = recipe_changes.unsafe(recipe_changes.changes(recipe, changed))
    if unsafe:  # a validator derived an unsafe key from a safe one
        raise RecipeError(SET_SOURCE, unsafe[0].key, f"would change too ({unsafe[0]}), which a run cannot")
    return changed


def _merge(into: dict[str, Any], overlay: Mapping[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _builder_inputs(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The values the request builder took from the deployment, read back from a recorded request."""
    env = recorded.get("Environment", {})
    output = recorded.get("OutputDataConfig", {})
    bucket = output.get("S3OutputPath", "s3://bucket/").removeprefix("s3://").split("/", 1)[0]
    vpc = recorded.get("VpcConfig") or {}
    return {
        "job_name": "job",
        "run": env.get("TRAINSTACK_RUN"),
        "checkpoint_uri": env.get("TRAINSTACK_CHECKPOINT_URI"),
        "role_arn": recorded.get("RoleArn", ""),
        "image_uri": recorded.get("AlgorithmSpecification", {}).get("TrainingImage", ""),
        "bucket_name": bucket,
        "kms_key_arn": output.get("KmsKeyId"),
        "region": env.get("AWS_REGION"),
        "subnet_ids": list(vpc.get("Subnets", [])),
        "security_group_ids": list(vpc.get("SecurityGroupIds", [])),
        "network_isolation": bool(recorded.get("EnableNetworkIsolation", False)),
        "inter_container_encryption": bool(recorded.get("EnableInterContainerTrafficEncryption", False)),
    }


def changed_request(recorded: Mapping[str, Any], before: Recipe, after: Recipe, team: str | None) -> dict:
    """The recorded request with the recipe change `before` -> `after` applied: every field where the
    builder's request for `after` differs from its request for `before` (same deployment values) takes
    the new value; every other field stays exactly as recorded."""
    inputs = _builder_inputs(recorded)
    old = builder.create_training_job_request(before, team, **inputs)
    # image.uri is the one recipe key the builder takes from the deployment instead (the image it
    # built or was given): a changed one is the image the next jobs run (`resume --set image.uri=`,
    # a trainer fix reaching a running run), the recorded one otherwise.
    image = after.image.uri if after.image.uri and after.image.uri != before.image.uri else None
    new = builder.create_training_job_request(
        after, team, **{**inputs, **({"image_uri": image} if image else {})}
    )
    patched = copy.deepcopy(dict(recorded))
    _apply_difference(patched, old, new)
    patched.pop(JOB_NAME, None)
    return patched


def _apply_difference(target: dict[str, Any], old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    for key in old.keys() | new.keys():
        if key == JOB_NAME:
            continue
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        if isinstance(before, Mapping) and isinstance(after, Mapping) and isinstance(target.get(key), dict):
            _apply_difference(target[key], before, after)
        elif key in new:
            target[key] = copy.deepcopy(after)
        else:
            target.pop(key, None)


def describe_changes(found: Iterable[recipe_changes.Change]) -> str:
    return "; ".join(str(c) for c in found)


def resume_step_environment(step: int | None) -> dict[str, str]:
    """The next job's own environment for `resume --from-step N` (never recorded in the request)."""
    if step is None:
        return {}
    if step < 0:
        raise TrainstackError(f"--from-step: {step} is not a step (0 or more)")
    return {builder.RESUME_STEP_ENV: str(step)}
