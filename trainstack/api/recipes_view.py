"""Looking at recipes without planning a run: `show` (the resolved recipe and which file set each value)
and `diff` (what a merge would deploy: the plans before and after against a git ref)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainstack.api.results import OnProgress, Result, report

if TYPE_CHECKING:
    from trainstack.gitops.gitdiff import PlanDiff
    from trainstack.recipes.loader import ResolvedRecipe


@dataclass(frozen=True)
class ShowResult(Result):
    """A resolved recipe with the source of every value; `to_json()` is `trainstack show --json`."""

    resolved: ResolvedRecipe
    team: str | None
    warnings: tuple[str, ...]
    tuned: str | None  # where the recipe's tuned layout comes from (the tuning store), if it was tuned

    @property
    def values(self) -> dict[str, object]:
        """Dotted leaf path -> value, in the recipe's order."""
        return flatten(self.resolved.recipe.model_dump(mode="json"))

    def to_document(self) -> dict[str, Any]:
        return {
            "recipe": self.resolved.recipe.model_dump(mode="json"),
            "sources": {path: self.resolved.source_of(path) for path in self.values},
            "files": list(self.resolved.files),
            "tuned": self.tuned,
        }


def show(
    recipe: str,
    *,
    team: str | None = None,
    overrides: Sequence[str] = (),
    recipes_dir: str | Path | None = None,
    warn: bool = True,
    on_warning: OnProgress = None,
) -> ShowResult:
    """The resolved recipe (`trainstack show`): every value with the file, --set or default that set it,
    the tuning run its tuned layout comes from, and (`warn`: the recipe is planned for them) the warnings
    about values that are legal but almost surely wrong, each also to `on_warning`."""
    from trainstack.planner import plan, sanity
    from trainstack.recipes.loader import resolve

    resolved = resolve(recipe, team=team, overrides=tuple(overrides), recipes_dir=recipes_dir)
    warnings = tuple(sanity.lines(resolved, plan(resolved.recipe), None)) if warn else ()
    for line in warnings:
        report(on_warning, line)
    return ShowResult(resolved, team, warnings, tuned_line(resolved.recipe.name, team))


def tuned_line(recipe: str, team: str | None) -> str | None:
    """Where the recipe's tuned layout comes from: "chosen by tuning run X on <date>: 1.18x tokens per
    dollar over the recipe's layout (--set ...)", from the tuning store; None when it was never tuned."""
    from trainstack.tuning.store import Store

    result = Store().latest_result(recipe, team)
    if result is None or result.get("overrides") is None:
        return None
    gain = result.get("gain")
    versus = (
        f"{gain:.2f}x tokens per dollar over the recipe's layout"
        if gain
        else "the recipe's layout did not complete"
    )
    flags = " ".join(f"--set {o}" for o in result["overrides"]) or "the recipe's own layout"
    return (
        f"chosen by tuning run {result['run']} on {result['date']} ({result['hardware']['instance_type']}, "
        f"{result['hardware']['gpu']}): {versus} ({flags}); `trainstack launch --tuned` uses it"
    )


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """Dotted leaf paths, as the loader records sources (tags.extra stays one value)."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "extra":
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


@dataclass(frozen=True)
class DiffResult(Result):
    """The plan diff against a git ref; `to_json()` is `trainstack diff --json`."""

    diff: PlanDiff

    def to_document(self) -> dict[str, Any]:
        return self.diff.to_dict()

    def to_markdown(self) -> str:
        """The Markdown the pull request shows (`trainstack diff --markdown`)."""
        from trainstack.gitops import report as diff_report

        return diff_report.to_markdown(self.diff)


def diff(
    base: str = "main",
    *,
    repo: str | Path | None = None,
    synth: bool = True,
    on_progress: OnProgress = None,
) -> DiffResult:
    """What a merge would deploy (`trainstack diff`): the recipe/team stack sets whose plans or templates
    change between `base` (a git ref) and the working tree, each plan before -> after. `synth`: when
    infrastructure files changed, synthesize both sides (a minute or two; progress to `on_progress`)
    and deploy only the stack sets whose templates differ."""
    from trainstack.gitops import gitdiff

    found = gitdiff.compute(
        base,
        None if repo is None else Path(repo),
        synth=synth,
        progress=lambda line: report(on_progress, line),
    )
    return DiffResult(found)
