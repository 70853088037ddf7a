"""`plan --compare`: the recipe re-planned on every catalogued instance type, each with the layout the
recommender picks there (micro-batch, checkpointing, shard group, nodes) for the same deadline: the
recipe's own planned time on its own instance type. A team's `compute.usd_per_instance_hour` prices
only the recipe's own type; the others use the catalogue (with the spot assumption if spot: true)."""

from __future__ import annotations

from dataclasses import dataclass

from trainstack.planner.core import Plan, plan
from trainstack.planner.search import TIE, Layout, recommend
from trainstack.recipes.hardware import INSTANCES
from trainstack.recipes.schema import Recipe


@dataclass(frozen=True)
class CompareRow:
    instance_type: str
    gpu: str
    nodes: int | None
    layout: str  # "micro-batch 1, full, shard group 8" (and the FP8 recipe when it had to change)
    micro_batch: int | None
    checkpointing: str | None
    shard_group: int | None
    fp8_recipe: str | None
    fits: bool
    tokens_per_sec_per_gpu: float | None
    tokens_per_sec_per_gpu_range: tuple[float, float] | None
    hours: float | None  # instance hours per node, as the cost counts them
    hours_range: tuple[float, float] | None
    total_usd: float | None
    total_usd_range: tuple[float, float] | None
    usd_per_instance_hour: float
    price_source: str
    is_recipe_instance: bool
    note: str = ""

    def to_dict(self) -> dict:
        d = self.__dict__.copy()
        for key in ("tokens_per_sec_per_gpu_range", "hours_range", "total_usd_range"):
            if d[key] is not None:
                d[key] = list(d[key])
        return d


def variant(recipe: Recipe, layout: Layout) -> Recipe:
    """`recipe` with `layout` applied (validated like any recipe)."""
    data = recipe.model_dump(mode="json")
    own_type = layout.instance_type == recipe.compute.instance_type
    data["compute"].update(instance_type=layout.instance_type, instance_count=layout.nodes)
    if not own_type:
        data["compute"]["usd_per_instance_hour"] = None  # a team's rate is for its own instance type
    data["training"]["micro_batch"] = layout.micro_batch
    data["activation_checkpointing"] = {"mode": layout.mode, "every": layout.every, "policy": layout.policy}
    if layout.mode != "selective":
        data["activation_checkpointing"]["policy"] = "block"
    data["parallelism"]["shard_group"] = layout.shard_group
    data["parallelism"]["cp"] = layout.cp
    gpu = INSTANCES[layout.instance_type].gpu
    if data["precision"]["fp8_recipe"] == "mxfp8" and not gpu.supports_mxfp8:
        data["precision"]["fp8_recipe"] = "current"
    return Recipe.model_validate(data)


def _row(recipe: Recipe, instance_type: str, chosen: Layout | None, note: str, own: bool) -> CompareRow:
    inst = INSTANCES[instance_type]
    if chosen is None:
        return CompareRow(
            instance_type, inst.gpu.name, None, "nothing fits", None, None, None, None, False,
            None, None, None, None, None, None, inst.usd_per_hour, inst.price_source, own, note,
        )  # fmt: skip
    replanned = variant(recipe, chosen)
    p: Plan = plan(replanned)
    fp8_recipe = replanned.precision.fp8_recipe
    layout = f"micro-batch {chosen.micro_batch}, {chosen.checkpointing}, shard group {chosen.shard_group}"
    if chosen.cp > 1:
        layout += f", cp {chosen.cp}"
    if fp8_recipe != recipe.precision.fp8_recipe:
        layout += f", fp8 {fp8_recipe} (mxfp8 needs Blackwell)"
    return CompareRow(
        instance_type=instance_type,
        gpu=inst.gpu.name,
        nodes=chosen.nodes,
        layout=layout,
        micro_batch=chosen.micro_batch,
        checkpointing=chosen.checkpointing,
        shard_group=chosen.shard_group,
        fp8_recipe=fp8_recipe,
        fits=p.fits,
        tokens_per_sec_per_gpu=p.throughput.tokens_per_sec_per_gpu,
        tokens_per_sec_per_gpu_range=p.throughput.tokens_per_sec_per_gpu_range,
        hours=p.cost.hours,
        hours_range=p.cost.hours_range,
        total_usd=p.cost.total_usd,
        total_usd_range=p.cost.total_usd_range,
        usd_per_instance_hour=p.cost.usd_per_instance_hour,
        price_source=p.cost.price_source,
        is_recipe_instance=own,
        note=note,
    )


def compare(recipe: Recipe, own_plan: Plan | None = None) -> list[CompareRow]:
    """One row per catalogued instance type, the recipe's own first."""
    own_plan = own_plan or plan(recipe)
    deadline = own_plan.recommendations.recipe_layout.hours * (1 + TIE)
    rows = []
    own_type = recipe.compute.instance_type
    for instance_type in [own_type, *sorted(t for t in INSTANCES if t != own_type)]:
        if instance_type == own_type:
            rec = own_plan.recommendations
        else:
            rec = recommend(recipe, instance_type=instance_type, deadline_hours=deadline)
        note = "; ".join(n for n in rec.notes if not n.startswith("precision.dtype"))
        rows.append(_row(recipe, instance_type, rec.recommended, note, instance_type == own_type))
    return rows
