"""Bounded input: how long the loader takes to refuse each hostile recipe file, and to read a good one.

    .venv/bin/python bench/bounded_input.py [--repeat N]

Writes each case into a temporary directory, resolves it N times (trainstack.recipes.loader.resolve, the
path every command and the CDK app take) and prints the best and median wall time and the peak memory
the process reached, with the one line each refusal prints. Every hostile case must be refused; a good
recipe must resolve (the last rows: the shipped 30b-fp8, and a 60 KiB recipe of comments, the largest
the bounds accept).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainstack.errors import TrainstackError  # noqa: E402
from trainstack.recipes import bounded_yaml  # noqa: E402
from trainstack.recipes.loader import resolve  # noqa: E402

BASE = (ROOT / "recipes" / "30b-fp8.yaml").read_text()


def bomb(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 {" + ", ".join(f"k{j}: x" for j in range(width)) + "}"]
    lines += [
        f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(width)) + "}"
        for i in range(1, levels)
    ]
    return "bomb:\n" + "".join(f"  {line}\n" for line in lines)


def cases(root: Path) -> list[tuple[str, Path, bool]]:
    """(what, path, whether it must resolve)."""

    def write(name: str, text: str) -> Path:
        (root / name).write_text(text)
        return root / name

    big = root / "big.yaml"
    with big.open("w") as out:
        out.write(BASE + "# " + "x" * (50 * 2**20) + "\n")
    (root / "loop.yaml").symlink_to("loop.yaml")
    return [
        ("anchor containing itself", write("self.yaml", BASE + "x: &a {y: *a}\n"), False),
        ("alias bomb (9^9 values)", write("bomb.yaml", BASE + bomb()), False),
        ("50 MB recipe", big, False),
        ("symlink to itself", root / "loop.yaml", False),
        ("nested 5,000 deep", write("deep.yaml", BASE + "x: " + "[" * 5000 + "]" * 5000 + "\n"), False),
        ("two documents", write("two.yaml", BASE + "---\n" + BASE), False),
        ("binary garbage", write("bin.yaml", bytes(range(256)).decode("latin-1") * 16), False),
        ("budget.max_run_usd: .inf", write("inf.yaml", BASE + "budget: {max_run_usd: .inf}\n"), False),
        ("shipped 30b-fp8", ROOT / "recipes" / "30b-fp8.yaml", True),
        (
            "60 KiB of comments (accepted)",
            write("comments.yaml", BASE + ("# " + "c" * 98 + "\n") * ((60 * 1024 - len(BASE)) // 101)),
            True,
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, libyaml parser: "
        f"{bounded_yaml._BASE_LOADER.__name__ == 'CSafeLoader'}"
    )
    print(f"{'case':32} {'best ms':>8} {'median ms':>10}  result")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for what, path, good in cases(Path(tmp)):
            times, outcome = [], ""
            for _ in range(args.repeat):
                start = time.perf_counter()
                try:
                    resolve(str(path))
                    outcome = "resolved"
                except TrainstackError as error:
                    outcome = str(error).split(": ", 1)[1][:70]
                times.append(time.perf_counter() - start)
            failed |= (outcome == "resolved") != good
            print(f"{what:32} {min(times) * 1e3:8.1f} {statistics.median(times) * 1e3:10.1f}  {outcome}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak memory of this process: {peak:.0f} MiB")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
