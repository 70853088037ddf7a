"""The --plot of `trainstack plan`: per-GPU memory by component across micro-batch sizes (stacked bars
with their totals, over-limit bars marked, the recipe's own micro-batch highlighted) and tokens/s per
GPU with its range on a second axis. matplotlib, Agg backend; written atomically, mode as the umask says."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from trainstack.errors import TrainstackError
from trainstack.recipes.schema import Recipe


def micro_batches(recipe: Recipe) -> list[int]:
    """Powers of two up to twice the largest that fits (at least 4 and the recipe's own), capped at 64."""
    from trainstack.planner import max_micro_batch

    best = max_micro_batch(recipe) or 1
    top = min(64, max(2 * best, recipe.training.micro_batch, 4))
    sizes = [1]
    while sizes[-1] * 2 <= top:
        sizes.append(sizes[-1] * 2)
    if recipe.training.micro_batch not in sizes:
        sizes = sorted({*sizes, recipe.training.micro_batch})
    return sizes


def plot_data(recipe: Recipe) -> dict:
    """What the plot draws, as numbers (tests read this rather than pixels)."""
    from trainstack.planner import HEADROOM, recipe_memory, recipe_throughput

    sizes = micro_batches(recipe)
    memory = [recipe_memory(recipe, micro_batch=mb) for mb in sizes]
    # tokens/s needs the global batch to split evenly: where it does not, that size has no tokens/s
    per_rank = recipe.training.global_batch // recipe.data_parallel
    speed = [recipe_throughput(recipe, micro_batch=mb) if per_rank % mb == 0 else None for mb in sizes]
    usable = recipe.instance.gpu.usable_gib
    return {
        "sizes": sizes,
        "memory": memory,
        "totals": [sum(parts.values()) for parts in memory],
        "usable": usable,
        "budget": usable * (1 - HEADROOM),
        "tokens_per_sec": [t.tokens_per_sec_per_gpu if t else None for t in speed],
        "tokens_per_sec_range": [t.tokens_per_sec_per_gpu_range if t else None for t in speed],
        "recipe_micro_batch": recipe.training.micro_batch,
    }


def write_memory_plot(recipe: Recipe, path: Path) -> None:
    if path.suffix.lower() != ".png":
        raise TrainstackError(f"--plot: {path}: the plot is a PNG; name the file *.png")
    if not path.parent.resolve().is_dir():
        raise TrainstackError(f"--plot: {path}: directory {path.parent} does not exist")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = plot_data(recipe)
    sizes, totals, usable = data["sizes"], data["totals"], data["usable"]
    labels = [str(mb) for mb in sizes]
    fig, ax = plt.subplots(figsize=(11, 7), dpi=110)
    bottom = [0.0] * len(sizes)
    for name in data["memory"][0]:
        values = [parts[name] for parts in data["memory"]]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, (mb, total) in enumerate(zip(sizes, totals, strict=True)):
        over = total > usable
        # the outline: red and hatched over usable memory, thick black for the recipe's own micro-batch
        ax.bar(
            i,
            total,
            fill=False,
            edgecolor="red" if over else "black",
            hatch="//" if over else None,
            linewidth=2.5 if mb == data["recipe_micro_batch"] else (1.5 if over else 0.0),
        )
        ax.annotate(
            f"{total:,.0f}" + (" over" if over else ""),
            (i, total),
            ha="center",
            va="bottom",
            fontsize=8,
            color="red" if over else "black",
            fontweight="bold" if mb == data["recipe_micro_batch"] else "normal",
        )
    ax.axhline(usable, color="black", linewidth=1.2, label=f"usable {usable:.0f} GiB")
    ax.axhline(data["budget"], color="black", linestyle="--", linewidth=1, label="usable less 10% headroom")
    ax.set_ylim(0, max(max(totals), usable) * 1.12)
    ax.set_xlabel(f"micro-batch (sequences of {recipe.training.seq_len} tokens); bold: the recipe's own")
    for tick in ax.get_xticklabels():
        if tick.get_text() == str(data["recipe_micro_batch"]):
            tick.set_fontweight("bold")
    ax.set_ylabel("GiB per GPU")
    from trainstack.planner import checkpointing_label

    ckpt = checkpointing_label(recipe.activation_checkpointing)
    ax.set_title(
        f"{recipe.name}: memory and speed per GPU on {recipe.instance.gpu.name} (checkpointing "
        f"{ckpt}, shard group {recipe.parallelism.shard_group})",
        fontsize=10,
    )
    speed = ax.twinx()
    speed.set_zorder(ax.get_zorder() + 1)  # the line and its band above the bars
    speed.patch.set_visible(False)
    xs = [i for i, t in enumerate(data["tokens_per_sec"]) if t is not None]
    if xs:
        tps = [data["tokens_per_sec"][i] for i in xs]
        low = [data["tokens_per_sec_range"][i][0] for i in xs]
        high = [data["tokens_per_sec_range"][i][1] for i in xs]
        speed.fill_between(xs, low, high, color="tab:purple", alpha=0.15, label="tokens/s range")
        speed.plot(xs, tps, color="tab:purple", marker="o", label="tokens/s per GPU")
        speed.set_ylim(0, max(high) * 1.15)
    speed.set_ylabel("tokens/s per GPU (line; band: range)")
    handles, names = ax.get_legend_handles_labels()
    more, more_names = speed.get_legend_handles_labels()
    fig.legend(handles + more, names + more_names, fontsize=7, loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))  # room below the axes for the legend
    # Write beside the target and rename, so a failure never leaves half a file behind; mkstemp makes
    # the file 0600, so give it the mode a plain open() would (0666 less the umask).
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=path.parent.resolve())
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
