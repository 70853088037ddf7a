"""The emulator's experiment tracker: MLflow's own tracking server (the `mlflow` package, dev extra), with
a SQLite backend store and artifacts on local disk, on localhost.

Offline, this is the real thing rather than a stand-in: the trainer and the CLI talk to it through the same
MLflow client and REST API they use against SageMaker's managed MLflow (where the client reaches the
server through the sagemaker-mlflow plugin's SigV4 signing instead). `trainstack emulator start` runs one
beside moto and records its URL in .emulator/endpoint.json (`mlflow`); the tests start one per session.

The server is started in its own process group (it runs uvicorn and a job runner as children): stopping
signals that group, and only it.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from trainstack.errors import TrainstackError

HEALTH = "/health"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MlflowServer:
    """`mlflow server` on 127.0.0.1 with its store under `root`; a context manager that always stops it."""

    root: Path
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    _process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def command(self) -> list[str]:
        self.root = Path(self.root).resolve()
        return [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]

    def start(self, timeout_s: float = 120.0) -> MlflowServer:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> MlflowServer:
        """Start the server process and return at once (`wait_ready` waits for it to answer)."""
        if not installed():
            raise TrainstackError("the mlflow package (dev extra) is not installed: run `make setup`")
        self.root = Path(self.root).resolve()
        (self.root / "artifacts").mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {
            **os.environ,
            "MLFLOW_DISABLE_TELEMETRY": "true",  # nothing leaves this machine
            # No background job runner (GenAI evaluation jobs): a second process importing mlflow,
            # seconds of start-up on a small machine, for nothing trainstack uses.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        self._process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: uvicorn and the job runner stop with it
            env=env,
        )
        if log is not subprocess.DEVNULL:
            log.close()
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> MlflowServer:
        deadline = time.monotonic() + timeout_s
        while not answers(self.url):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise TrainstackError(f"the local MLflow server did not start on port {self.port}")
            time.sleep(0.25)
        return self

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            _signal_group(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=5)  # reap the leader, or the group's check below sees its zombie
            except subprocess.TimeoutExpired:
                pass
            stop_group(self._process.pid, timeout_s=2.0)
        self._process = None

    def __enter__(self) -> MlflowServer:
        return self if self._process is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def installed() -> bool:
    found = importlib.util.find_spec
    return found("mlflow") is not None and found("mlflow.server") is not None


# --- beside the emulator: recorded in .emulator/endpoint.json, stopped with it ----------------------
STATE_DIR = Path(".emulator") / "mlflow"
LOG_FILE = Path(".emulator") / "mlflow.log"


def launch_beside(state_dir: Path = STATE_DIR, log_path: Path = LOG_FILE) -> MlflowServer | None:
    """Start an MLflow server for the emulator (detached: its own session outlives this process); None,
    with nothing started, when the mlflow package is not installed."""
    if not installed():
        return None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return MlflowServer(state_dir, log_path=log_path).launch()


def is_mlflow_server(pid: int) -> bool:
    """Whether `pid` is a live `mlflow server` (so `stop` never signals a process that reused the id)."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return "mlflow" in text and " server " in f"{text} "


def stop_recorded(state: dict) -> None:
    """Stop the MLflow server an emulator record names (`mlflow_pid`), if it still runs."""
    pid = state.get("mlflow_pid")
    if isinstance(pid, int) and pid > 0 and is_mlflow_server(pid):
        stop_group(pid)


def answers(url: str, timeout_s: float = 2.0) -> bool:
    try:
        urllib.request.urlopen(f"{url}{HEALTH}", timeout=timeout_s).close()
    except OSError:
        return False
    return True


def stop_group(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group that server `pid` leads (started with start_new_session), then SIGKILL."""
    if not _signal_group(pid, signal.SIGTERM):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
    _signal_group(pid, signal.SIGKILL)


def _signal_group(pid: int, signum: int) -> bool:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True
