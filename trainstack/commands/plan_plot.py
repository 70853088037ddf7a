"""The --plot of `trainstack plan`: stacked per-GPU memory across micro-batch sizes (matplotlib, Agg)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from trainstack.errors import TrainstackError
from trainstack.recipe import Recipe


def micro_batches(recipe: Recipe) -> list[int]:
    """Powers of two up to twice the largest that fits (at least up to the recipe's own), capped at 64."""
    from trainstack.planner import recommend

    best = recommend(recipe).max_micro_batch or 1
    top = min(64, max(2 * best, recipe.training.micro_batch, 2))
    sizes = [1]
    while sizes[-1] * 2 <= top:
        sizes.append(sizes[-1] * 2)
    if recipe.training.micro_batch not in sizes:
        sizes = sorted({*sizes, recipe.training.micro_batch})
    return sizes


def write_memory_plot(recipe: Recipe, path: Path) -> None:
    if path.suffix.lower() != ".png":
        raise TrainstackError(f"--plot: {path}: the plot is a PNG; name the file *.png")
    if not path.parent.resolve().is_dir():
        raise TrainstackError(f"--plot: {path}: directory {path.parent} does not exist")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainstack.planner import HEADROOM, _recipe_memory

    sizes = micro_batches(recipe)
    rows = [_recipe_memory(recipe, micro_batch=mb) for mb in sizes]
    components = list(rows[0])
    usable = recipe.instance.gpu.usable_gib
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    labels = [str(mb) for mb in sizes]
    bottom = [0.0] * len(sizes)
    for name in components:
        values = [row[name] for row in rows]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.axhline(usable, color="black", linewidth=1.2, label=f"usable {usable:.0f} GiB")
    ax.axhline(
        usable * (1 - HEADROOM),
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"usable less {HEADROOM:.0%} headroom",
    )
    ax.set_xlabel(
        f"micro-batch (sequences of {recipe.training.seq_len} tokens); recipe uses "
        f"{recipe.training.micro_batch}"
    )
    ax.set_ylabel("GiB per GPU")
    ax.set_title(
        f"{recipe.name}: peak memory per GPU on {recipe.instance.gpu.name} (checkpointing: "
        f"{recipe.activation_checkpointing.mode}, shard group {recipe.parallelism.shard_group})"
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    # Write beside the target and rename, so a failure never leaves half a file behind.
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=path.parent.resolve())
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
