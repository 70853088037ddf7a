"""`make demo`'s own parts that the docs test (which runs it against an emulator already running) does
not reach: starting the emulator detached and recording the server's PID, and the "Try next" list
naming real commands within 120 columns."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack.emulator import endpoint as emu

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
TRAINSTACK = str(Path(sys.executable).parent / "trainstack")


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_next_steps_are_real_commands_within_120_columns(tmp_path):
    demo = load_demo()
    text = demo.next_steps(
        "30b-fp8", None, "http://localhost:5555", {"pid": 4242}, demo.ROOT / ".emulator/moto.log"
    )
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= 120
    assert "pid 4242" in text and lines[-2].strip().startswith(".venv/bin/trainstack emulator stop")
    commands = [x.split("#")[0].strip() for x in lines if x.startswith("  ")]
    for command in commands:
        words = command.replace('"$(', "").split()
        if words[0] == "eval":
            words = words[1:]
        program, *args = words
        assert program == ".venv/bin/trainstack", command
        sub = [a for a in args if not a.startswith("-")][:1]
        done = subprocess.run([TRAINSTACK, *sub, "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (command, done.stderr)


@pytest.mark.slow
@pytest.mark.xdist_group("emulator")
def test_the_demo_records_the_servers_pid_and_leaves_it_running(tmp_path):
    demo = load_demo()
    state, log = tmp_path / "endpoint.json", demo.ROOT / ".emulator" / "moto-test.log"
    log.parent.mkdir(exist_ok=True)
    server = emu.Emulator(log_path=log)
    demo.start_recorded(server, state, log)
    try:
        recorded = emu.read_state(state)
        assert recorded["pid"] == server.pid and emu.is_emulator_process(server.pid)
        assert recorded["endpoint"] == server.endpoint and emu.running(state) == recorded
    finally:
        assert emu.stop_recorded(state)["pid"] == server.pid
        log.unlink(missing_ok=True)
    assert not emu.is_emulator_process(server.pid) and not state.exists()
