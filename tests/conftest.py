"""The suite's two tiers, and the rule that every test belongs to one.

- `fast`: `make test`, the tier a developer waits on (at most 10 minutes on a fresh 2-core clone, set-up
  included): unit, contract and CDK-gate tests, the trainer at 1-2 ranks, one whole run on the emulator.
- `slow`: `make test-all` only (what CI's `.ci/run` calls): the docs walkthrough, every other whole run, the
  fault and multi-node suites.

A module says its tier with `pytestmark = pytest.mark.fast` (or `slow`); a `slow` mark on one test of a
fast module moves that test alone. Not the other way round: `-m "not slow"` deselects every test that
carries a slow mark at any level, so a fast test inside a slow module would silently leave the fast tier.
A test with neither is a collection error naming its file, so a new module cannot silently fall out of
both tiers (tests/test_suite_grouping.py pins this rule on a throwaway tree).
"""

from __future__ import annotations

import pytest

TIERS = ("fast", "slow")


def tier_of(item: pytest.Item) -> str | None:
    """`slow` wins over `fast`, as `-m "not slow"` sees it; None: the test belongs to no tier."""
    marks = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
    if "slow" in marks:
        return "slow"
    return "fast" if "fast" in marks else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before `-m` deselects anything: refuse the run when any collected test has no tier."""
    untiered = sorted({item.nodeid.split("::")[0] for item in items if tier_of(item) is None})
    if untiered:
        raise pytest.UsageError(
            "tests that belong to no tier (add `pytestmark = pytest.mark.fast` or `pytest.mark.slow`, "
            "tests/conftest.py): " + ", ".join(untiered)
        )


# How many tests ran and how many `-m "not slow"` left out, said at the end of `make test`.
# Under xdist the workers collect and deselect, and the controller prints only "N items": each worker
# hands its count back through `workeroutput`, the channel xdist gives for it.
def pytest_collection_finish(session: pytest.Session) -> None:
    deselected = getattr(session.config, "_tier_deselected", 0)
    session.config._tier_counts = {"ran": len(session.items), "deselected": deselected}
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["tier_counts"] = session.config._tier_counts


@pytest.hookimpl(trylast=True)
def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        config = items[0].config
        config._tier_deselected = getattr(config, "_tier_deselected", 0) + len(items)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    counts = getattr(node, "workeroutput", {}).get("tier_counts")
    if counts:
        node.config._tier_counts = counts


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    counts = getattr(config, "_tier_counts", None)
    if counts and "not slow" in (config.option.markexpr or ""):
        terminalreporter.write_line(
            f"the fast tier: {counts['ran']} tests selected, {counts['deselected']} of the slow tier "
            "deselected (make test-all runs every test)"
        )
