"""`python -m trainstack.emulator` as a user runs it: it records the server (and itself as supervisor)
for `--local`, and `kill PID` (SIGTERM) stops it as Ctrl-C does, taking the moto server and the state
file with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trainstack.emulator.endpoint import is_emulator_process

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("emulator")]


def test_sigterm_stops_the_server_and_removes_the_state_file(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainstack.emulator"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state = tmp_path / ".emulator" / "endpoint.json"
    try:
        deadline = time.monotonic() + 60
        while not state.is_file():
            assert proc.poll() is None and time.monotonic() < deadline, "the emulator did not start"
            time.sleep(0.2)
        recorded = json.loads(state.read_text())
        assert recorded["supervisor_pid"] == proc.pid
        assert recorded["pid"] != proc.pid and is_emulator_process(recorded["pid"])  # the server itself
        urllib.request.urlopen(f"{recorded['endpoint']}/moto-api/data.json", timeout=5).close()

        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not state.exists()
        with pytest.raises(OSError):  # the moto server went with it
            urllib.request.urlopen(f"{recorded['endpoint']}/moto-api/data.json", timeout=5).close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_started_emulator_used_as_a_context_manager_runs_one_server_and_stops_it() -> None:
    from trainstack.emulator.endpoint import Emulator

    with Emulator().start(timeout_s=120) as emulator:
        pid = emulator._process.pid
        servers = subprocess.run(
            ["pgrep", "-f", f"trainstack.emulator --serve --port {emulator.port}$"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert servers == [str(pid)]  # `start()` then `with`: not a second server
    deadline = time.monotonic() + 15
    while is_emulator_process(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_emulator_process(pid)
