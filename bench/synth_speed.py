#!/usr/bin/env python3
"""Wall time of `npx cdk synth` for one recipe and for `-c recipe=all`, next to a minimal one-bucket
CDK app timed in the same run (the floor: Node CLI + jsii + aws-cdk-lib start-up and one template).

Goal (issue 3): one recipe within 1.5x of the floor, all recipes within 3x. Prints a Markdown table
for docs/benchmarks.md. `--repeat N` runs each case N times and reports the median.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOOR_APP = """\
import os
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
from aws_cdk import App, Stack, aws_s3 as s3
app = App()
s3.Bucket(Stack(app, "Floor"), "Bucket")
app.synth()
"""


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--recipe", default="30b-fp8")
    args = parser.parse_args()
    npx = shutil.which("npx")
    if npx is None:
        sys.exit("error: npx not found (Node.js 20+ and `make setup` are needed)")
    env = {
        **os.environ,
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
        "CDK_DISABLE_CLI_TELEMETRY": "true",
        "AWS_REGION": os.environ.get("AWS_REGION", "us-west-2"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "CDK_DEFAULT_ACCOUNT": os.environ.get("CDK_DEFAULT_ACCOUNT", "123456789012"),
        "CDK_DEFAULT_REGION": os.environ.get("CDK_DEFAULT_REGION", "us-west-2"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        floor_dir = Path(tmp) / "floor"
        floor_dir.mkdir()
        (floor_dir / "app.py").write_text(FLOOR_APP)
        cases = {
            "minimal one-bucket app (floor)": (
                [
                    npx,
                    "--prefix",
                    str(ROOT),
                    "cdk",
                    "synth",
                    "-q",
                    "--app",
                    f"{sys.executable} app.py",
                    "-o",
                    str(Path(tmp) / "o0"),
                ],
                floor_dir,
            ),
            f"one recipe (-c recipe={args.recipe})": (
                [npx, "cdk", "synth", "-q", "-c", f"recipe={args.recipe}", "-o", str(Path(tmp) / "o1")],
                ROOT,
            ),
            "every recipe and team variant (-c recipe=all)": (
                [npx, "cdk", "synth", "-q", "-c", "recipe=all", "-o", str(Path(tmp) / "o2")],
                ROOT,
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeat):  # interleaved, so load on the machine affects every case alike
            for name, (cmd, cwd) in cases.items():
                times[name].append(timed(cmd, cwd, env))
        stacks = len(list((Path(tmp) / "o2").glob("*.template.json")))
    floor = statistics.median(times["minimal one-bucket app (floor)"])
    goals = [None, 1.5, 3.0]
    print(
        f"## CDK synth\n\nMachine: {platform.machine()}, {os.cpu_count()} CPUs ({platform.platform()}), "
        f"Python {platform.python_version()}; date {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
        f"`python bench/synth_speed.py --repeat {args.repeat}` (median of {args.repeat} runs, interleaved).\n"
    )
    print("| case | median s | runs s | x floor | goal |")
    print("|---|---|---|---|---|")
    verdicts = []
    for (name, samples), goal in zip(times.items(), goals, strict=True):
        median = statistics.median(samples)
        ratio = median / floor
        mark = "" if goal is None else (f"<= {goal}x: {'met' if ratio <= goal else 'NOT met'}")
        if goal is not None:
            verdicts.append(ratio <= goal)
        print(f"| {name} | {median:.1f} | {', '.join(f'{s:.1f}' for s in samples)} | {ratio:.2f} | {mark} |")
    print(
        f"\n`-c recipe=all` wrote {stacks} stack templates. Both trainstack cases include config validation, "
        "the planner, cdk-nag on every stack and monitoring; the floor has none of these. The base-image "
        "lookup is cached in .cache/base-images.json after the first run (sagemaker-core import, ~1.5 s)."
    )
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
