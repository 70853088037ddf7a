#!/usr/bin/env python3
"""What experiment tracking costs the training loop: step time with tracking off, on (MLflow's own
server, as the emulator runs it), with the tracker down (a closed port) and throttling (a loopback server
that holds every request for 2 s, then answers 503); plus the training thread's own cost per log step.

    .venv/bin/python bench/tracking_overhead.py [--steps 40] [--repeats 1]

The trainer runs the CPU tiny recipe (tests/trainer/fixtures/tiny.yaml, one process, log every step: the
worst case, a metric record per step) and the step times are read from its own metric lines
(`step_time_s`, trainstack.protocol.metrics), the first 5 steps left out (warm-up). Figures go to
docs/benchmarks.md ("Experiment tracking").
"""

from __future__ import annotations

import argparse
import http.server
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = ROOT / "tests" / "trainer" / "fixtures" / "tiny.yaml"
WARMUP = 5
THROTTLE_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Throttling(http.server.BaseHTTPRequestHandler):
    """A tracker that takes THROTTLE_S to refuse every request (503), as an overloaded one does."""

    def _slow_refusal(self) -> None:
        time.sleep(THROTTLE_S)
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _slow_refusal  # noqa: N815

    def log_message(self, *args) -> None:
        pass


def train(steps: int, env: dict[str, str], work: Path) -> tuple[list[float], str]:
    command = [
        sys.executable, "-m", "trainer", "--recipe", str(TINY), "--device", "cpu", "--synthetic",
        "--max-steps", str(steps), "--checkpoint-dir", str(work / "ck"),
        "--set", "checkpointing.interval_steps=1000",
    ]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"trainer failed ({done.returncode}):\n{done.stderr[-3000:]}")
    from trainstack.protocol.metrics import parse_line

    times = [parse_line(line)["step_time_s"] for line in done.stdout.splitlines() if line.startswith("step=")]
    report = next((line for line in done.stderr.splitlines() if "records delivered" in line), "")
    return times[WARMUP:], report.split("trainer.tracking: ")[-1]


def per_call_costs() -> tuple[float, float]:
    """The training thread's cost of one log step's record, tracker unreachable: (log_line us, put us)."""
    from trainer.metrics.delivery import Delivery
    from trainer.metrics.tracking import Tracking

    hung = threading.Event()
    delivery = Delivery("bench", lambda batch: hung.wait(30), capacity=10_000)
    tracking = Tracking(deliveries=[delivery])
    line = (
        "step=1 loss=2.4131 lr=0.0003 tokens_per_sec=245000.0 tflops_per_gpu=1510.2 mfu=0.3356 mem_gib=151.2 "
        "step_time_s=5.35 straggler_host=3 straggler_rank=17 straggler_compute_s=1.92 straggler_skew=0.04"
    )
    n = 20_000
    started = time.perf_counter()
    for step in range(n):
        tracking.log_line(step, line, grad_norm=1.0)
    log_line_us = (time.perf_counter() - started) / n * 1e6
    started = time.perf_counter()
    for i in range(n):
        delivery.put(i)
    put_us = (time.perf_counter() - started) / n * 1e6
    hung.set()
    delivery.close(0.1)
    return log_line_us, put_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from trainstack.emulator.mlflow_server import MlflowServer

    log_line_us, put_us = per_call_costs()
    print(f"training thread, per log step: log_line {log_line_us:.1f} us (parse + put), put {put_us:.2f} us")
    throttler = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Throttling)
    threading.Thread(target=throttler.serve_forever, daemon=True).start()
    results: dict[str, list[float]] = {}
    reports: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp, MlflowServer(Path(tmp) / "mlflow").start() as server:
        cases = {
            "off": {},
            "on (local MLflow server)": {"MLFLOW_TRACKING_URI": server.url},
            "tracker down (closed port)": {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"},
            f"tracker throttling ({THROTTLE_S:.0f} s, 503)": {
                "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{throttler.server_address[1]}"
            },
        }
        for repeat in range(args.repeats):
            for index, (name, env) in enumerate(cases.items()):
                run_env = {**env, "TRAINSTACK_RUN": f"ts-platform-tiny-cpu--bench{repeat}{index}"}
                times, report = train(args.steps, run_env, Path(tmp) / f"{repeat}-{index}")
                results.setdefault(name, []).extend(times)
                reports[name] = report
    throttler.shutdown()
    off = statistics.median(results["off"])
    print(f"step time, CPU tiny recipe, {args.steps} steps x {args.repeats}, first {WARMUP} left out:")
    for name, times in results.items():
        median, worst = statistics.median(times), max(times)
        print(
            f"  {name:<34} median {median * 1000:7.1f} ms ({(median / off - 1) * 100:+5.1f}% vs off), "
            f"max {worst * 1000:7.1f} ms"
        )
        if reports[name]:
            print(f"  {'':<34} {reports[name].split(' (last error')[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
