"""`trainstack diff` rendered: Markdown for the pull request (one line per stack set, `before → after`
in each cell) and a terminal table that fits 120 columns (before and after stacked in each cell, stack
names never broken), followed by the same notes: which infrastructure files changed, how templates
were compared, the template changes per stack set, and why a target is invalid."""

from __future__ import annotations

from trainstack.gitops.gitdiff import PlanDiff, TargetDiff

COLUMNS = ("Stacks", "Change", "Fits", "Peak GiB", "Tokens/s/GPU", "MFU", "Hours", "Cost", "Approval")
TERMINAL_COLUMNS = (
    "Stack set",
    "Change",
    "Fits",
    "Peak GiB",
    "tok/s/GPU",
    "MFU",
    "Hours",
    "Cost",
    "Approval",
)
ARROW = " → "
STACK_PREFIX = "Trainstack-"
MAX_LISTED = 10  # template changes and files listed per note before "and N more"


def _figures(t: TargetDiff, ranges: bool = False) -> list[tuple]:
    """Each figure before and after; with `ranges`, speed, hours and cost with the planner's range."""
    b = t.before.figures if t.before else None
    a = t.after.figures if t.after else None

    def ranged(value: float, bounds: tuple[float, float], spec: str, unit: str = "") -> str:
        central = f"{unit}{value:{spec}}"
        low, high = bounds
        return f"{central} ({unit}{low:{spec}}-{high:{spec}})" if ranges and high > 0 else central

    fields = (
        lambda f: "yes" if f.fits else "NO",
        lambda f: f"{f.peak_gib:.1f}",
        lambda f: ranged(f.tokens_per_sec_per_gpu, f.tokens_per_sec_per_gpu_range, ",.0f"),
        lambda f: f"{100 * f.mfu:.1f}%",
        lambda f: ranged(f.hours, f.hours_range, ",.1f"),
        lambda f: ranged(f.total_usd, f.total_usd_range, ",.0f", "$"),
    )
    return [(shown(b) if b else "-", shown(a) if a else "-") for shown in fields]


def _approval(t: TargetDiff) -> str:
    return "required" if t.after and t.after.needs_approval else ("-" if not t.deploys else "no")


def _change(t: TargetDiff) -> str:
    if t.status == "code":
        if t.resources:
            return f"code ({len(t.resources)} template change(s))"
        return f"code ({len(t.reasons)} infrastructure file(s) changed; templates not compared)"
    return t.status + (f" ({', '.join(t.reasons)})" if t.reasons else "")


def row(t: TargetDiff) -> list[str]:
    """One Markdown row: each figure `before → after` (one value when equal, `-` for a missing side)."""
    change = (
        f"invalid: {t.after.error}" if t.status == "invalid" and t.after and t.after.error else _change(t)
    )
    cells = [left if left == right else f"{left}{ARROW}{right}" for left, right in _figures(t, ranges=True)]
    return [t.stack, change, *cells, _approval(t)]


def terminal_row(t: TargetDiff) -> list[str]:
    """One terminal row: the stack set without the common prefix, before above `→ after` in each cell;
    reasons and errors go to the notes below the table, so no cell grows wide."""
    cells = [left if left == right else f"{left}\n→ {right}" for left, right in _figures(t)]
    return [t.stack.removeprefix(STACK_PREFIX), t.status, *cells, _approval(t)]


def headline(diff: PlanDiff) -> str:
    names = ", ".join(t.stack for t in diff.deploys)
    if not diff.deploys:
        if diff.infra_files and "compared" in diff.templates and "not compared" not in diff.templates:
            return "A merge deploys no stacks (infrastructure files changed, every template is identical)."
        return "A merge deploys no stacks."
    return f"A merge deploys {len(diff.deploys)} recipe/team stack set(s): {names}"


def _listed(items: tuple[str, ...] | list[str], quote: str = "") -> str:
    shown = ", ".join(f"{quote}{x}{quote}" for x in items[:MAX_LISTED])
    return shown + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def notes(diff: PlanDiff, markdown: bool = False) -> list[str]:
    """The lines under the table (both formats): files, how templates were judged, what changed."""
    quote = "`" if markdown else ""
    out: list[str] = []
    if diff.infra_files:
        out.append(f"Infrastructure files changed: {_listed(diff.infra_files, quote)}.")
        out.append(f"How their effect was judged: {diff.templates}.")
    recipe_files = [f for f in diff.changed_files if f.startswith("recipes/")]
    if recipe_files:
        out.append(f"Recipe files changed: {_listed(recipe_files, quote)}.")
    groups: dict[tuple[str, ...], list[str]] = {}  # the same changes in many stack sets: said once
    for t in diff.shown:
        if t.resources:
            groups.setdefault(t.resources, []).append(t.stack)
    for resources, stacks in groups.items():
        where = f"{quote}{stacks[0]}{quote}" if len(stacks) == 1 else f"{len(stacks)} stack sets"
        out.append(f"Template changes in {where}: {_listed(resources, quote)}.")
        if len(stacks) > 1:
            out.append(f"  (the same in {', '.join(stacks)})")
    for t in diff.shown:
        if not markdown and t.status == "invalid" and t.after and t.after.error:
            out.append(f"Invalid {t.stack}: {t.after.error}")
        if not markdown and t.status in ("changed", "added") and t.reasons:
            out.append(f"{t.stack} {t.status} by {_listed(t.reasons)}.")
    if any(t.status == "removed" for t in diff.targets):
        out.append(
            "Removed targets are not destroyed by a merge: run `npx cdk destroy` for them deliberately "
            "(checkpoint buckets are retained either way)."
        )
    if any(t.status == "invalid" for t in diff.targets):
        out.append(
            ("**Invalid targets block the merge:**" if markdown else "Invalid targets block the merge:")
            + " fix them before merging (`trainstack validate`)."
        )
    return out


def to_markdown(diff: PlanDiff) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        f"### trainstack plan diff against `{diff.base}` ({diff.base_commit[:12]})",
        "",
        f"**{headline(diff)}**",
        "",
    ]
    if diff.shown:
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cell(c) for c in row(t)) + " |" for t in diff.shown]
        lines.append("")
    for note in notes(diff, markdown=True):
        lines += [note, ""]
    return "\n".join(lines)
