"""A small wheelhouse of the pure-Python packages the trainer imports, for a GPU machine without them.

The GPU machine this workplace lends has torch, numpy and pyyaml but no pydantic and no network, and
the trainer's modules import the recipe schema (pydantic). Build the wheels here, carry them, and
bench/trainer_gpu.py unpacks the ones matching its interpreter onto sys.path there (no pip needed):

    .venv/bin/python bench/wheelhouse.py                   # -> build/wheelhouse/*.whl (about 2.5 MB)
    .venv/bin/python bench/wheelhouse.py --python 3.11     # for another CPython

Versions are the project's pins (requirements.lock). `build/` is git-ignored, so the device run names
`build/wheelhouse` in its carry list (docs/benchmarks.md, ## Trainer).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = REPO / "build" / "wheelhouse"
# pydantic and everything it needs at import (its Requires-Dist, without extras).
PACKAGES = ("pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions")
# The H200 machine's interpreter (KINDS.md: Python 3.12.3) and the manylinux tags pip must match exactly.
DEFAULT_PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions(lock: Path = REPO / "requirements.lock") -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            pins[_normalise(name)] = version.split(";")[0].strip()
    return pins


def download_command(python: str, destination: Path, pins: dict[str, str]) -> list[str]:
    requirements = [f"{name}=={pins[_normalise(name)]}" for name in PACKAGES]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        python,
        *platforms,
        "--dest",
        str(destination),
        *requirements,
    ]


def wheel_fits(filename: str, python: tuple[int, int], machine: str = "x86_64") -> bool:
    """Whether a wheel's tags fit this CPython on Linux `machine` (py3-none-any, or cpXY / abi3)."""
    stem = filename.removesuffix(".whl")
    try:
        python_tag, abi_tag, platform_tag = stem.split("-")[-3:]
    except ValueError:
        return False
    if platform_tag == "any":
        return "py3" in python_tag.split(".") or any(t.startswith("cp3") for t in python_tag.split("."))
    if machine not in platform_tag or "linux" not in platform_tag:
        return False
    tag = f"cp{python[0]}{python[1]}"
    if abi_tag == "abi3":
        return any(t.startswith("cp3") and int(t[3:] or 0) <= python[1] for t in python_tag.split("."))
    return tag in python_tag.split(".")


def make_importable(module: str, wheelhouse: Path = WHEELHOUSE) -> str:
    """Import `module` from site-packages, or else from the carried wheelhouse (unpacked into a
    temporary directory put first on sys.path). Returns where it came from."""
    if importlib.util.find_spec(module) is not None:
        return "installed"
    wheels = sorted(wheelhouse.glob("*.whl")) if wheelhouse.is_dir() else []
    fitting = [w for w in wheels if wheel_fits(w.name, sys.version_info[:2])]
    if not fitting:
        raise SystemExit(
            f"error: {module} is not installed and {wheelhouse} has no wheel for this Python "
            f"({sys.version_info[0]}.{sys.version_info[1]}); build it with: python bench/wheelhouse.py "
            f"--python {sys.version_info[0]}.{sys.version_info[1]}"
        )
    target = Path(tempfile.mkdtemp(prefix="trainstack-wheels-"))
    for wheel in fitting:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"error: {module} is still not importable from {wheelhouse}")
    return f"wheelhouse ({len(fitting)} wheels from {wheelhouse})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=DEFAULT_PYTHON, help=f"target CPython (default {DEFAULT_PYTHON})")
    parser.add_argument("--dest", type=Path, default=WHEELHOUSE)
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    command = download_command(args.python, args.dest, pinned_versions())
    print(" ".join(command), flush=True)
    result = subprocess.run(command)
    if result.returncode:
        return result.returncode
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
