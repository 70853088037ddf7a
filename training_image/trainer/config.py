"""What the trainer is told: the resolved recipe, and the layout on the ranks actually running.

The recipe comes from `--recipe FILE` (a recipe YAML, layered by trainstack.recipes.loader; a full recipe
JSON; or a SageMaker hyperparameters JSON) or, on SageMaker, from
/opt/ml/input/config/hyperparameters.json through `trainstack.recipes.schema.from_hyperparameters`, the one
encoding the launcher writes.

Layout: the recipe plans for instance_count x 8 GPUs. The trainer lays out the ranks torchrun
actually started (they match on SageMaker; a 2-process CPU test runs a recipe planned for 8 GPUs):
data-parallel degree = world size, gradient accumulation = global_batch / (micro_batch x world), and
the FSDP shard group is the recipe's shard_group, or the whole world when shard_group is larger.
Anything that does not divide is an error naming the recipe field, never a silent change of batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from trainstack.errors import RecipeError
from trainstack.protocol.container import opt_ml
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import Recipe, from_hyperparameters

# /opt/ml/... on SageMaker; under $TRAINSTACK_OPT_ML in the local emulator (trainstack.protocol.container)
SAGEMAKER_HYPERPARAMETERS = opt_ml("input/config/hyperparameters.json")


def _validation_error(source: str, exc: ValidationError) -> RecipeError:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or None
    return RecipeError(source, field, first["msg"].removeprefix("Value error, "))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(str(path), None, "file not found") from None
    except json.JSONDecodeError as exc:
        raise RecipeError(str(path), None, f"not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise RecipeError(str(path), None, "expected a JSON object")
    return data


def recipe_from_json(path: Path) -> Recipe:
    """A full recipe JSON object, or SageMaker hyperparameters (flat dotted keys, JSON-string values)."""
    data = _read_json(path)
    is_hyperparameters = all(isinstance(v, str) for v in data.values()) and any("." in k for k in data)
    try:
        return from_hyperparameters(data) if is_hyperparameters else Recipe.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(str(path), exc) from None
    except json.JSONDecodeError as exc:
        raise RecipeError(str(path), None, f"a hyperparameter value is not JSON ({exc.msg})") from None


def load_recipe(recipe: str | None, overrides: tuple[str, ...] = ()) -> tuple[Recipe, str]:
    """(recipe, where it came from)."""
    if recipe is None:
        if not SAGEMAKER_HYPERPARAMETERS.is_file():
            raise RecipeError("--recipe", None, f"not given, and {SAGEMAKER_HYPERPARAMETERS} does not exist")
        if overrides:
            raise RecipeError("--set", None, "applies to recipe YAML files only")
        return recipe_from_json(SAGEMAKER_HYPERPARAMETERS), str(SAGEMAKER_HYPERPARAMETERS)
    if recipe.endswith(".json"):
        if overrides:
            raise RecipeError("--set", None, "applies to recipe YAML files only")
        return recipe_from_json(Path(recipe)), recipe
    return resolve(recipe, overrides=overrides).recipe, recipe


@dataclass(frozen=True)
class Layout:
    world: int
    shard: int  # FSDP shard group; replicas = world // shard (HSDP when > 1)
    micro_batch: int
    grad_accum: int
    global_batch: int

    @property
    def replicas(self) -> int:
        return self.world // self.shard


def resolve_layout(recipe: Recipe, world: int, source: str) -> Layout:
    par, tr = recipe.parallelism, recipe.training
    shard = min(par.shard_group, world)
    if world % shard:
        raise RecipeError(
            source, "parallelism.shard_group", f"{par.shard_group} does not divide the {world} ranks running"
        )
    per_micro_step = tr.micro_batch * world
    if tr.global_batch % per_micro_step:
        raise RecipeError(
            source,
            "training.global_batch",
            f"{tr.global_batch} is not a multiple of micro_batch x ranks = "
            f"{tr.micro_batch} x {world} = {per_micro_step}",
        )
    return Layout(world, shard, tr.micro_batch, tr.global_batch // per_micro_step, tr.global_batch)
