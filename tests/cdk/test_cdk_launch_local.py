"""`trainstack launch --local` without an emulator, and the base-image cache: fast, no AWS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainstack import config
from trainstack.loader import resolve

TRAINSTACK = str(Path(sys.executable).parent / "trainstack")


def test_launch_local_without_an_emulator_says_so_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [TRAINSTACK, "launch", "30b-fp8", "--local", "--recipes-dir", str(root / "recipes")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: no local emulator is running "
        "(start one with `python -m trainstack.emulator`, or run `make demo`)"
    ]


def test_base_image_answers_are_cached(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "base-images.json"
    recipe = resolve("30b-fp8").recipe
    first = config.resolve_base_image("eu-west-1", recipe, cache=cache)
    assert first == "763104351884.dkr.ecr.eu-west-1.amazonaws.com/pytorch-training:2.9-gpu-py312"
    assert first in cache.read_text()

    def unreachable(*args: object) -> str:
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(config, "_retrieve", unreachable)
    assert config.resolve_base_image("eu-west-1", recipe, cache=cache) == first
