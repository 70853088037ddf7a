"""The embedded default: a local AWS endpoint (moto in server mode) on localhost.

Used by `make demo`, the integration tests and `trainstack ... --local`. Everything that is special
about the emulator lives here, visibly, so nothing real AWS gets is weakened to suit it. Its known
gaps and our workarounds (../shared/README.md section 7):

- the endpoint must be `localhost` (moto parses CDK's TemplateURL by host name);
- Step Functions executions only run after `POST /moto-api/config` enables them;
- it cannot run containers or Lambda, and its training jobs go straight to Completed: trainstack.emulator.jobs
  runs them as local processes instead (below);
- resource types its CloudFormation does not implement (CloudWatch alarms, bucket and topic
  policies, ...) become placeholders: `serve()` below gives them a physical
  id and answers `Fn::GetAtt` with a made-up ARN, so templates that reference them deploy. They
  are never created, so template assertions (tests/cdk), not the emulator, check them;
- it names state machines past Step Functions' 80-character limit and then rejects them: `serve()`
  shortens them as CloudFormation does;
- with execution enabled, its CloudFormation puts state machines where its Step Functions API does
  not look: `serve()` points both at the interpreter's backend;
- its definition parser shares query-language scopes across parses, so one failed or concurrent parse
  makes it refuse valid definitions afterwards: `isolate_definition_parses()` gives each parse its own;
- it does not publish CloudFormation stack status events to EventBridge (launch_on_deploy):
  `deliver_stack_status()` plays EventBridge from the deployed rule's own pattern and target;
- its training jobs complete at once, keep no Environment, cannot be stopped, and send no state-change
  events: trainstack.emulator.jobs runs training and processing jobs for real as local processes, with
  SageMaker's container contract; trainstack.emulator.events adds StopTrainingJob, the test-only modes
  ("hold", "complete": `Emulator(jobs=...)`) and delivery.

`trainstack emulator start|status|stop|env` runs one in the background (what `make demo` leaves
running); `python -m trainstack.emulator [--port N]` runs one in the foreground. Either records the
server's endpoint and PID in .emulator/endpoint.json, where `--local` and `trainstack emulator stop`
find it, in that directory or any below it (state_file).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainstack.errors import TrainstackError

REGION = "us-east-1"
TRAINSTACK_ROUTE = "/_trainstack/"  # the emulator's own control endpoints (trainstack.emulator.events)
# Whether the server answers: a route of our own. moto's /moto-api/data.json serializes every backend, and
# with a walkthrough's stacks, executions and logs in it took more than its 2 s timeout, so each
# `trainstack emulator env` waited out running()'s 30 s before saying the emulator was up.
PING_ROUTE = TRAINSTACK_ROUTE + "ping"
JOBS_DIR_ENV = "TRAINSTACK_EMULATOR_JOBS_DIR"  # the server's jobs folder (trainstack.emulator.jobs)
ACCOUNT = "123456789012"  # moto's default account
# Dummy credentials: the emulator accepts any, and they keep a real profile from ever being used.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Emulator:
    """A moto server process. Use as a context manager; it is always stopped on exit."""

    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    # Where jobs' /opt/ml folders and logs go (trainstack.emulator.jobs); default: `jobs` beside the log,
    # else .emulator/jobs.
    jobs_dir: Path | None = None
    # How new training jobs are treated: "train" (they run); for a test that asks, "hold" or "complete"
    # (trainstack.emulator.events.configure).
    jobs: str = "train"
    _process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://localhost:{self.port}"

    def client(self, service: str) -> Any:
        """A boto3 client for this emulator only."""
        (made,) = clients(self.env(), service)
        return made

    def env(self) -> dict[str, str]:
        """Environment for any AWS client (boto3, the CDK CLI) to talk to this emulator only."""
        return {
            **CREDENTIALS,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "CDK_DEFAULT_ACCOUNT": ACCOUNT,
            "CDK_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    @property
    def pid(self) -> int | None:
        """The moto server's process id (None when not started here)."""
        return self._process.pid if self._process is not None else None

    def start(self, timeout_s: float = 120.0, detach: bool = False) -> Emulator:
        """Start the server and wait until it answers. `detach`: in its own session, so it outlives this
        process and a Ctrl-C in this terminal (stop it with `trainstack emulator stop`)."""
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
            raise TrainstackError("moto[server] is not installed: run `make setup`")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # moto's server runs through serve() below (not the moto_server script): it adds our patches.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "trainstack.emulator", "--serve", "--port", str(self.port)],
            env={**os.environ, JOBS_DIR_ENV: str(self.jobs_directory)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=detach,
        )
        if log is not subprocess.DEVNULL:
            log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + timeout_s
        while not answers(self.endpoint):
            exited = self._process.poll()
            if exited is not None or time.monotonic() > deadline:
                self.stop()
                why = (
                    f"its server exited with {exited}"
                    if exited is not None
                    else f"not within {timeout_s:g} s"
                )
                where = f"; its log: {self.log_path}" if self.log_path else ""
                raise TrainstackError(
                    f"the local AWS emulator did not start on port {self.port} ({why}{where})"
                ) from None
            time.sleep(0.2)
        self._configure({"stepfunctions": {"execute_state_machine": True}})
        if self.jobs != "train":  # a test-only mode (trainstack.emulator.events.configure)
            self._configure({"jobs": self.jobs}, route=f"{TRAINSTACK_ROUTE}config")
        return self

    @property
    def jobs_directory(self) -> Path:
        if self.jobs_dir is not None:
            return Path(self.jobs_dir).resolve()
        base = Path(self.log_path).parent if self.log_path else Path(".emulator")
        return (base / "jobs").resolve()

    def _configure(self, config: dict, route: str = "/moto-api/config") -> None:
        request = urllib.request.Request(
            f"{self.endpoint}{route}",
            data=json.dumps(config).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                # The server kills its jobs' process trees on SIGTERM; a SIGKILL before it is done would
                # leave them running (30 s: a loaded 2-core machine).
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def __enter__(self) -> Emulator:
        # `with Emulator().start(timeout_s=...) as e:` is started already: a second start would leak the
        # first server (only the second is stopped on exit).
        return self if self.running else self.start()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- state file: lets `trainstack ... --local` and `trainstack emulator stop` find a running emulator --
STATE_FILE = Path(".emulator") / "endpoint.json"
LOG_FILE = Path(".emulator") / "moto.log"
NOT_RUNNING = (
    "no local emulator is running: AWS_ENDPOINT_URL is unset and no live one is recorded in "
    "{path} in this directory or above it{elsewhere} (start one here with `trainstack emulator start`, "
    "or export the AWS_ENDPOINT_URL it printed)"
)


def state_file(start: Path | None = None) -> Path:
    """The record of the emulator a command run in `start` (default: the working directory) uses:
    .emulator/endpoint.json there or in the nearest directory above that has one, as git finds .git, so
    commands work from any subdirectory of where the emulator was started. STATE_FILE (here) when none."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / STATE_FILE).is_file():
            return directory / STATE_FILE
    return STATE_FILE


def running_elsewhere() -> list[tuple[Path, str]]:
    """Emulators of this user running anywhere on this machine: (the directory each was started in, its
    endpoint), for an error that says where they are. Found from the processes (/proc: each server's
    working directory holds its record); empty without procfs (macOS)."""
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or not is_emulator_process(int(entry.name)):
            continue
        try:
            directory = Path(os.readlink(entry / "cwd"))
        except OSError:  # another user's process, or gone
            continue
        state = read_state(directory / STATE_FILE)
        if state is not None and state.get("pid") == int(entry.name):
            found.append((directory, state["endpoint"]))
    return sorted(found)


def write_state(
    endpoint: str,
    pid: int,
    path: Path = STATE_FILE,
    log: Path | None = None,
    supervisor_pid: int | None = None,
    mlflow: Any = None,
) -> None:
    """Record a running emulator: `pid` is the moto server's own process (what `stop` signals);
    `supervisor_pid` the foreground `python -m trainstack.emulator` watching it, if any; `mlflow` the
    MLflow server beside it (trainstack.emulator.mlflow_server), recorded as its URL and PID."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"endpoint": endpoint, "pid": pid, "started": time.time()}
    if mlflow is not None:
        state.update(mlflow=mlflow.url, mlflow_pid=mlflow.pid)
    if log is not None:
        state["log"] = str(log)
    if supervisor_pid is not None:
        state["supervisor_pid"] = supervisor_pid
    path.write_text(json.dumps(state))


def read_state(path: Path = STATE_FILE) -> dict | None:
    """The recorded emulator (endpoint, pid, ...), or None when nothing (readable) is recorded."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("endpoint"), str):
        return None
    return state


def answers(endpoint: str, timeout_s: float = 2.0) -> bool:
    try:
        urllib.request.urlopen(f"{endpoint}{PING_ROUTE}", timeout=timeout_s).close()
    except OSError:
        return False
    return True


def is_emulator_process(pid: int) -> bool:
    """Whether `pid` is a live emulator server (so `stop` never signals a process that reused the id)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():
        text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    else:  # no procfs (macOS): ask ps
        done = subprocess.run(["ps", "-p", str(pid), "-o", "command="], capture_output=True, text=True)
        text = done.stdout
    return "trainstack.emulator" in text and "--serve" in text


def running(path: Path | None = None, timeout_s: float = 30.0) -> dict | None:
    """The recorded emulator (`path`, default: state_file()) if it is alive, else None. Alive: its server
    process runs (a busy server answers late, and must not be taken for a dead one and replaced), or,
    for a record without a server PID we can check, its endpoint answers within `timeout_s`."""
    state = read_state(path or state_file())
    if state is None:
        return None
    pid = state.get("pid")
    if isinstance(pid, int) and pid > 0:
        if not is_emulator_process(pid):
            return None  # stale: the server is gone (or the PID now belongs to something else)
        deadline = time.monotonic() + timeout_s
        while not answers(state["endpoint"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        return state
    return state if answers(state["endpoint"], timeout_s=timeout_s) else None


def stop_recorded(path: Path | None = None, timeout_s: float = 30.0) -> dict | None:
    """Stop the recorded emulator's server (`path`, default: state_file()) (SIGTERM, then SIGKILL after
    `timeout_s`) and remove the record. Returns the record it stopped, or None when none was running (a
    stale record is removed)."""
    path = path or state_file()
    state = read_state(path)
    if state is None:
        return None
    pid = state.get("pid")
    stopped = None
    if isinstance(pid, int) and is_emulator_process(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while is_emulator_process(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if is_emulator_process(pid):
            os.kill(pid, signal.SIGKILL)
        stopped = state
    from trainstack.emulator import mlflow_server  # the tracker beside it goes with it

    mlflow_server.stop_recorded(state)
    path.unlink(missing_ok=True)
    return stopped


def env_for(endpoint: str) -> dict[str, str]:
    """The AWS environment for the emulator at `endpoint` (http://localhost:PORT)."""
    return Emulator(port=int(endpoint.rsplit(":", 1)[1])).env()


def local_env(path: Path | None = None) -> dict[str, str]:
    """Environment for the emulator recorded in `path` (default: state_file()), or a one-line error when
    none is running that says where this user's running emulators were started, if any."""
    state = running(path or state_file())
    if state is None:
        others = running_elsewhere()
        elsewhere = (
            "; running elsewhere: "
            + ", ".join(f"{endpoint} (started in {directory}: cd there)" for directory, endpoint in others)
            if others
            else ""
        )
        raise TrainstackError(NOT_RUNNING.format(path=STATE_FILE, elsewhere=elsewhere))
    return env_for(state["endpoint"])


def export_line(env: dict[str, str]) -> str:
    return "export " + " ".join(f"{k}={v}" for k, v in env.items())


# --- EventBridge for CloudFormation stack status events (moto does not publish them) -------------


def local_endpoint(env: Mapping[str, str]) -> str:
    """`env`'s AWS_ENDPOINT_URL, which must be on this machine (what everything emulator-only checks)."""
    endpoint = env.get("AWS_ENDPOINT_URL", "")
    if urlsplit(endpoint).hostname not in ("localhost", "127.0.0.1"):
        raise TrainstackError(f"not a local emulator endpoint: {endpoint or '(AWS_ENDPOINT_URL unset)'}")
    return endpoint


def clients(env: Mapping[str, str], *services: str) -> list[Any]:
    """boto3 clients for the local emulator `env` names (`Emulator.env()`, or the environment of the one
    `trainstack emulator start` recorded); refuses any endpoint that is not on this machine, so its
    dummy credentials never reach AWS."""
    import boto3

    endpoint = local_endpoint(env)
    session = boto3.session.Session(
        region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=env.get("AWS_SESSION_TOKEN"),
    )
    return [session.client(service, endpoint_url=endpoint) for service in services]


def deliver_stack_status(env: dict[str, str], stack_name: str, status: str = "UPDATE_COMPLETE") -> list[str]:
    """Do what EventBridge does on real AWS when `stack_name` reaches `status`: start every Step
    Functions target of every rule whose pattern matches that event, with the target's Input.
    Returns the execution ARNs started. Only the pattern fields our rules use are matched."""
    cfn, events, sfn = clients(env, "cloudformation", "events", "stepfunctions")
    stack_id = cfn.describe_stacks(StackName=stack_name)["Stacks"][0]["StackId"]
    event = {
        "source": "aws.cloudformation",
        "detail-type": "CloudFormation Stack Status Change",
        "detail": {"stack-id": stack_id, "status-details": {"status": status}},
    }
    started = []
    for rule in events.list_rules()["Rules"]:
        pattern = json.loads(rule.get("EventPattern") or "{}")
        if rule.get("State") != "ENABLED" or not _matches(pattern, event):
            continue
        for target in events.list_targets_by_rule(Rule=rule["Name"])["Targets"]:
            if ":states:" in target["Arn"]:
                run = sfn.start_execution(stateMachineArn=target["Arn"], input=target.get("Input", "{}"))
                started.append(run["executionArn"])
    return started


def _matches(pattern: object, value: object) -> bool:
    if isinstance(pattern, dict):
        return isinstance(value, dict) and all(
            k in value and _matches(v, value[k]) for k, v in pattern.items()
        )
    if isinstance(pattern, list):
        return value in pattern
    return pattern == value
