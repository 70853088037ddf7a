"""EMULATOR: what a training job's recipe becomes on this machine: as written when it fits, else its stand-in.

A base recipe (8B to 64B, 8K sequences, hundreds of sequences a step) cannot train on a laptop's CPU,
yet `make demo`, the tests and users launch them on the emulator to see the control plane work. Such a job
still runs the trainer for real, on a stand-in: the recipe with its model scaled down and everything else
as given (steps, learning-rate schedule, checkpoints, validation, tracking, stops, data channels and
tokenizer, instance type and count):

- model: STAND_IN_SHAPE (2 blocks of width 32, 4 heads, 2 KV heads when the recipe uses grouped-query
  attention, else 4), the recipe's own vocabulary (its tokenizer's ids must fit) and tied embeddings;
  model.init_from is dropped (a base model's weights do not fit the stand-in's shape);
- a step: micro_batch 1 and global_batch 8 x nodes (one sequence per planned GPU, the least the recipe's
  own layout check accepts), seq_len at most STAND_IN_SEQ_LEN (32) tokens, loss chunks at most that.
  A base recipe's vocabulary (128K-152K) makes the output layer most of a stand-in's compute, so its
  cost grows with tokens x width x vocabulary: 32 tokens x 32 wide instead of 128 x 64 made a 30b-fp8
  stand-in step 3.1x cheaper (bench/stand_in_step.py, docs/benchmarks.md);
- precision bf16 (Transformer Engine's FP8 needs a GPU), tensor and context parallelism 1 (the trainer's
  CPU path shards with FSDP only), training.compile off.

"Fits": the planner's per-GPU memory arithmetic (trainstack.planner.core.recipe_memory: parameters,
gradients and AdamW states sharded over the ranks, activations at the recipe's sequence length and
micro-batch, logits; not its CUDA context and NCCL buffers, which a CPU rank has not) for the ranks the
recipe's own nodes run here (its instance_count x ranks per node, all on this machine), summed, is at
most HOST_MEMORY_FRACTION of this machine's physical memory (the rest is left to the emulator, MLflow
and whatever else runs). A recipe that fits trains as written. The decision depends only on the recipe
and the machine, not on the job's own node count, so a run's export job (one node) restores the
stand-in its training jobs saved.

The note the emulator logs, and puts in the job's Environment as TRAINSTACK_EMULATOR_STAND_IN, starts
with STAND_IN_NOTE_PREFIX. Pure functions, except `host_memory_bytes`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainstack.recipes.schema import Recipe

HOST_MEMORY_FRACTION = 0.5
STAND_IN_SHAPE = {"layers": 2, "hidden": 32, "heads": 4, "ffn": 88}
STAND_IN_SEQ_LEN = 32
PLANNED_GPUS_PER_NODE = 8  # the recipe's own layout check counts 8 GPUs a node
STAND_IN_NOTE_PREFIX = "stand-in"
GIB = 1024**3
GPU_ONLY = ("CUDA context", "NCCL buffers")  # the planner's per-GPU constants; a CPU rank has neither


@dataclass(frozen=True)
class Decision:
    hyperparameters: dict[str, str]  # what the container's hyperparameters.json holds
    ranks_per_node: int
    note: str | None = None  # one line when the job trains a stand-in (None: as written)


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * GIB  # a laptop's, when the system does not say


def ranks_per_node(recipe: Recipe, nodes: int, most: int) -> int:
    """The most ranks per node, at most `most`, that the trainer's layout accepts: the global batch a
    multiple of micro_batch x ranks, and the shard group dividing the ranks (trainer.config)."""
    for ranks in range(max(1, most), 0, -1):
        world = ranks * nodes
        shard = min(recipe.parallelism.shard_group, world)
        if recipe.training.global_batch % (recipe.training.micro_batch * world) == 0 and world % shard == 0:
            return ranks
    return 1


def planned_gib(recipe: Recipe, world: int) -> float:
    """The planner's memory for `recipe` on `world` ranks, all of them (GiB)."""
    from trainstack.planner.core import recipe_memory

    per_rank = recipe_memory(recipe, shard_group=min(recipe.parallelism.shard_group, world), tp=1, cp=1)
    return sum(v for k, v in per_rank.items() if k not in GPU_ONLY) * world


def fits(recipe: Recipe, world: int, host_bytes: int) -> tuple[bool, float, float]:
    """(fits, planned GiB, budget GiB) for `recipe` on `world` ranks of this machine."""
    need = planned_gib(recipe, world)
    budget = host_bytes * HOST_MEMORY_FRACTION / GIB
    return need <= budget, need, budget


def stand_in_recipe(recipe: Recipe, nodes: int) -> Recipe:
    """`recipe` with its model and step scaled down as the module docstring lists; the rest as given."""
    m = recipe.model
    kv_heads = 2 if m.kv_heads < m.heads else STAND_IN_SHAPE["heads"]
    model = {
        **STAND_IN_SHAPE,
        "kv_heads": kv_heads,
        "head_dim": STAND_IN_SHAPE["hidden"] // STAND_IN_SHAPE["heads"],
        "vocab": m.vocab,
        "tied_embeddings": m.tied_embeddings,
        "rope_theta": m.rope_theta,
        "norm_eps": m.norm_eps,
        "init_from": None,
        "rope_scaling": None,
        "attention_bias": m.attention_bias,
    }
    seq_len = min(recipe.training.seq_len, STAND_IN_SEQ_LEN)
    training = {
        "seq_len": seq_len,
        "micro_batch": 1,
        "global_batch": PLANNED_GPUS_PER_NODE * nodes,
        "loss_chunk_tokens": min(recipe.training.loss_chunk_tokens, seq_len),
        "compile": False,
    }
    data = recipe.model_dump(mode="json", exclude={"extends"})
    data["model"] = {**data["model"], **model}
    data["training"] = {**data["training"], **training}
    data["precision"] = {"dtype": "bf16", "fp8_recipe": None}
    data["parallelism"] = {**data["parallelism"], "tp": 1, "cp": 1}
    ac = data["activation_checkpointing"]
    if ac.get("mode") == "selective":
        ac["every"] = min(ac.get("every", 2), STAND_IN_SHAPE["layers"])
    return Recipe.model_validate(data)


def describe(recipe: Recipe, stand_in: Recipe, need_gib: float, budget_gib: float, world: int) -> str:
    m, s = recipe.model, stand_in.model
    return (
        f"{STAND_IN_NOTE_PREFIX}: recipe {recipe.name} needs {need_gib:,.0f} GiB for {world} CPU rank(s) by "
        f"the planner's arithmetic, more than this machine's {budget_gib:,.1f} GiB budget; training its "
        f"stand-in ({s.layers} layers x {s.hidden} wide instead of {m.layers} x {m.hidden}, vocab "
        f"{s.vocab}, seq_len {stand_in.training.seq_len}, global_batch {stand_in.training.global_batch}, "
        f"bf16); steps, checkpoints, validation, tracking and stops as the recipe says"
    )


def decide(
    hyperparameters: Mapping[str, str], nodes: int, most_ranks: int, host_bytes: int, cpus: int = 2
) -> Decision:
    """The hyperparameters a training job's container gets on this machine, and its ranks per node.
    Hyperparameters that are not a trainstack recipe go through unchanged. A job of many nodes runs
    fewer ranks per node, at least one, so that all of them together are no more than the CPUs (or
    `most_ranks`, whichever is more): 2 nodes on 2 cores run one rank each, 8 nodes one each too."""
    from trainstack.recipes.schema import from_hyperparameters, to_hyperparameters

    given = dict(hyperparameters)
    try:
        recipe = from_hyperparameters(given)
    except Exception:  # not a recipe: another container's hyperparameters
        return Decision(given, max(1, most_ranks))
    per_node = max(1, min(most_ranks, max(cpus, most_ranks) // max(1, nodes)))
    # Fits and the stand-in are decided for the recipe's own nodes, whatever this job's count: a run's
    # export job (one node) then gets the same stand-in its training jobs trained.
    planned = recipe.compute.instance_count
    planned_per_node = max(1, min(most_ranks, max(cpus, most_ranks) // planned))
    world = ranks_per_node(recipe, planned, planned_per_node) * planned
    ok, need, budget = fits(recipe, world, host_bytes)
    if ok:
        return Decision(given, ranks_per_node(recipe, nodes, per_node))
    stand_in = stand_in_recipe(recipe, planned)
    encoded = to_hyperparameters(stand_in)
    extra = {k: v for k, v in given.items() if k not in to_hyperparameters(recipe)}  # sagemaker_* and such
    note = describe(recipe, stand_in, need, budget, world)
    return Decision({**encoded, **extra}, ranks_per_node(stand_in, nodes, per_node), note)


def for_job(
    hyperparameters: Mapping[str, str], nodes: int, most_ranks: int, command: Sequence[str]
) -> Decision:
    """`decide` for this machine."""
    return decide(hyperparameters, nodes, most_ranks, host_memory_bytes(), os.cpu_count() or 1)
