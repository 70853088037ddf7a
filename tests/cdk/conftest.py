"""One in-process synthesis of `-c recipe=all` (every base recipe, and every team's recipes), shared by
the template gates. Synthesis itself is the cdk-nag gate: any unacknowledged finding fails it."""

from __future__ import annotations

from pathlib import Path

import pytest
from cdk_helpers import synth, templates


@pytest.fixture(scope="session")
def all_outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth({"recipe": "all"}, tmp_path_factory.mktemp("cdk-all"))


@pytest.fixture(scope="session")
def all_templates(all_outdir: Path) -> dict[str, dict]:
    return templates(all_outdir)
