"""EMULATOR: the jobs the emulator is given run for real, as local processes, with SageMaker's contract.

The emulator's server process (trainstack.emulator.server) calls `start_training_job` /
`start_processing_job` from its CreateTrainingJob / CreateProcessingJob handlers (trainstack.emulator.events),
so a job created by anyone, a deployed Step Functions state machine included, trains with nobody calling
anything by hand. No Docker: each "node" of a job is one process tree on this machine, started from the
job's own entry point with SageMaker's container contract (../shared/README.md section 15; AWS developer
guide "Containers with custom training algorithms", "How Amazon SageMaker provides training information"):

- the entry point: AlgorithmSpecification's ContainerEntrypoint + ContainerArguments (a processing job's
  AppSpecification), else the training image's own, `python -m trainer.entrypoint train` (its Dockerfile's
  ENTRYPOINT and CMD). `python` is this emulator's interpreter, whose environment has the trainer
  installed (`make setup`): the image is not pulled, the code of this checkout stands in for it;
- one directory per node, `<jobs dir>/<job>/algo-<n>/`, stands in for /opt/ml: the trainer reads every
  contract path through $TRAINSTACK_OPT_ML (trainstack.protocol.container), and container arguments or
  LocalPaths written against /opt/ml are moved under it. In it: input/config/hyperparameters.json,
  resourceconfig.json (current_host algo-<n>, hosts, instance groups, network_interface_name: the
  loopback interface), inputdataconfig.json; input/data/<channel>/; model/; output/data/; output/failure;
  checkpoints/. The jobs directory: $TRAINSTACK_EMULATOR_JOBS_DIR of the server (Emulator(jobs_dir=...)),
  by default `jobs` beside the emulator's log, else .emulator/jobs;
- channels: File mode copies the channel's S3 prefix from the emulator's S3 before the entry point starts
  (ShardedByS3Key: host n of N gets every N-th key, sorted); FastFile is the same copy, with the mode
  recorded as FastFile in inputdataconfig.json: the trainer reads a local folder either way (on SageMaker
  FastFile streams on first read), so only the time to first step differs;
- environment: the request's Environment; TRAINING_JOB_NAME, TRAINING_JOB_ARN; SM_CURRENT_HOST, SM_HOSTS,
  SM_CHANNELS, SM_CHANNEL_<NAME>, SM_MODEL_DIR, SM_OUTPUT_DATA_DIR, SM_NUM_GPUS (0), SM_NUM_CPUS and the
  other SM_* of the SageMaker training toolkit; the emulator's endpoint and dummy credentials as the
  job's AWS credentials (AWS_ENDPOINT_URL, so the trainer's direct S3 checkpoints, TRAINSTACK_CHECKPOINT_URI,
  land in the emulator's S3); MLFLOW_TRACKING_URI, when it names an MLflow ARN (the emulator's MLflow App is
  a placeholder), is replaced by the emulator's own MLflow server (`configure(mlflow_url=...)`, else the
  `mlflow` URL recorded in .emulator/endpoint.json), or removed when there is none;
- nodes and ranks: InstanceCount nodes, each up to `ranks_per_node` CPU ranks (TRAINSTACK_NPROC_PER_NODE;
  default RANKS_PER_NODE = 2; fewer when all nodes' ranks would outnumber the CPUs, or when the recipe's
  global batch does not divide: trainstack.emulator.stand_in.decide), torchrun's gloo
  rendezvous on algo-1 (TRAINSTACK_RENDEZVOUS=127.0.0.1:<free port>) as on SageMaker; OMP_NUM_THREADS per
  rank = the CPUs divided by every rank running (this job's and the other local jobs'), at least 1, so a
  job never asks for more threads than cores (bench/emulator_threads.py compares 1 and 2 a rank);
- checkpoints and outputs: CheckpointConfig.S3Uri is copied to LocalPath (default /opt/ml/checkpoints)
  before the start and LocalPath back to S3Uri after the end (SageMaker also syncs while running; our
  trainer writes its checkpoints to S3 itself, TRAINSTACK_CHECKPOINT_URI); /opt/ml/model and
  /opt/ml/output/data (algo-1's) go to `<S3OutputPath>/<job>/output/model.tar.gz` and `output.tar.gz`;
  TensorBoardOutputConfig.LocalPath to its S3OutputPath; a processing job's ProcessingOutputs to theirs.

A job's life, as DescribeTrainingJob reports it (API reference, SecondaryStatusTransition): InProgress with
Starting -> Downloading (channels or checkpoints to copy) -> Training -> Uploading, then Completed,
Failed (FailureReason: the first host's /opt/ml/output/failure, else the exit code) or Stopped.
StopTrainingJob and MaxRuntimeInSeconds (from TrainingStartTime) send SIGTERM to each node's entry point
("SageMaker sends the algorithm the SIGTERM signal, which delays job termination for 120 seconds": the
API reference of StopTrainingJob) and SIGKILL to its process group `kill_after_seconds` (120) later; the
job passes through Stopping to Stopped, secondary Stopped or MaxRuntimeExceeded. Every change goes
through trainstack.emulator.events.change_job_status (handed to `start_*_job`), the one place that
changes a job's status.

Logs: each node's output, line by line, to CloudWatch Logs (moto's logs backend) in group
/aws/sagemaker/TrainingJobs (ProcessingJobs), stream `<job>/algo-<n>-<epoch seconds of the start>`, and
to `<jobs dir>/<job>/algo-<n>.log`. MetricDefinitions: each regex is searched in each line; its first
group, read as a number, is the metric's value at that line's time (finite values only: CloudWatch takes
no NaN); every value goes to CloudWatch metrics (namespace /aws/sagemaker/TrainingJobs, dimension
TrainingJobName) and the last of each metric to DescribeTrainingJob's FinalMetricDataList.

A recipe too large for this machine trains as its stand-in (trainstack.emulator.stand_in): its
hyperparameters.json is the stand-in's, the log's first line says so, and the job's Environment as
DescribeTrainingJob returns it carries TRAINSTACK_EMULATOR_STAND_IN (what `trainstack status` and
`trainstack runs` show).

Nothing here runs against real AWS: the S3 and logs clients are the emulator's own endpoint.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainstack.protocol.container import OPT_ML_ENV, map_opt_ml

BASE_CHANNEL = "base"  # trainstack.aws.channels.BASE_CHANNEL (the emulator imports no aws code)

RANKS_PER_NODE = 2  # CPU ranks per emulated node (fewer when the recipe's batch does not divide)
KILL_AFTER_S = 120.0  # SIGTERM -> SIGKILL, as SageMaker (StopTrainingJob's API reference)
TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
PROCESSING_LOG_GROUP = "/aws/sagemaker/ProcessingJobs"
METRICS_NAMESPACE = "/aws/sagemaker/TrainingJobs"
METRIC_DIMENSION = "TrainingJobName"
STAND_IN_ENV = "TRAINSTACK_EMULATOR_STAND_IN"  # the stand-in's one-line description (emulator only)
FAILURE_REASON_MAX = 1024  # SageMaker keeps this much of the failure file
IMAGE_ENTRYPOINT = ("python", "-m", "trainer.entrypoint", "train")  # training_image/Dockerfile
POLL_S = 0.2
FLUSH_S = 1.0
# Variables of the emulator's own process a job must not inherit (a container starts from its image's
# environment and the job's): the launching shell's AWS settings, tracker and trainstack switches.
FAULT_INJECT_ENV = "TRAINSTACK_FAULT_INJECT"  # trainer.runtime.faults.ENV (the trainer is not imported here)
NOT_INHERITED = ("AWS_", "MLFLOW_", "TRAINSTACK_", "SM_", "OMP_", "MKL_")


@dataclass
class Settings:
    """What the server knows about itself (set by `configure_server`)."""

    endpoint: str = ""  # http://localhost:PORT, the emulator's own
    region: str = "us-east-1"
    jobs_dir: Path = Path(".emulator") / "jobs"
    ranks_per_node: int = RANKS_PER_NODE
    kill_after_s: float = KILL_AFTER_S
    mlflow_url: str | None = None
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_runtime_cap_s: float | None = None  # new jobs' MaxRuntimeInSeconds capped at this (demo, tests)
    # TRAINSTACK_FAULT_INJECT for the training jobs created from now on (tests only: a real crash, a real
    # divergence; trainer.runtime.faults). A container's environment is its image's and its request's, so
    # nothing else reaches it from the test's process (NOT_INHERITED).
    fault_inject: str | None = None


SETTINGS = Settings()


def _capped_runtime(seconds: int | None) -> float | None:
    """A new training job's MaxRuntimeInSeconds as this emulator enforces it: as requested, or at most
    `max_runtime_cap_s` when a demo or test set one (events.configure(max_runtime_cap_seconds=...)): a
    recipe's max runtime is at least an hour, too long to show a run continuing after it on a laptop."""
    cap = SETTINGS.max_runtime_cap_s
    if cap is None:
        return seconds
    return cap if seconds is None else min(float(seconds), cap)


_RUNNING: dict[str, LocalJob] = {}
_LOCK = threading.Lock()


def configure_server(endpoint: str, jobs_dir: Path | None = None) -> None:
    SETTINGS.endpoint = endpoint
    if jobs_dir is not None:
        SETTINGS.jobs_dir = Path(jobs_dir).resolve()
    else:
        SETTINGS.jobs_dir = SETTINGS.jobs_dir.resolve()


def _client_error_types() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError)


ClientErrorLike = _client_error_types()


# --- Pure parts of the contract ---------------------------------------------------------------------


def container_command(spec: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """The command a node runs: the job's ContainerEntrypoint + ContainerArguments, else the image's own
    entry point; a leading `python` is this interpreter."""
    entrypoint = list(spec.get("ContainerEntrypoint") or [])
    arguments = list(spec.get("ContainerArguments") or [])
    command = entrypoint + arguments if entrypoint else [*IMAGE_ENTRYPOINT[:3], *(arguments or ["train"])]
    if command and command[0] in ("python", "python3"):
        command[0] = python
    return command


def host_names(count: int) -> list[str]:
    return [f"algo-{n}" for n in range(1, count + 1)]


def loopback_interface() -> str:
    """The loopback interface's name (lo on Linux, lo0 on macOS): what gloo binds to between 'nodes'."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    return next((n for n in names if n.startswith("lo")), "lo")


def resource_config(host: str, hosts: Sequence[str], instance_type: str) -> dict[str, Any]:
    """resourceconfig.json as SageMaker writes it for one homogeneous cluster."""
    return {
        "current_host": host,
        "current_instance_type": instance_type,
        "current_group_name": "homogeneousCluster",
        "hosts": list(hosts),
        "instance_groups": [
            {
                "instance_group_name": "homogeneousCluster",
                "instance_type": instance_type,
                "hosts": list(hosts),
            }
        ],
        "network_interface_name": loopback_interface(),
    }


def input_data_config(channels: Sequence[Mapping[str, Any]], job_mode: str) -> dict[str, Any]:
    """inputdataconfig.json: per channel its ContentType, TrainingInputMode, S3DistributionType and
    RecordWrapperType (the channel's InputMode overrides the job's TrainingInputMode)."""
    found = {}
    for channel in channels:
        source = channel.get("DataSource", {}).get("S3DataSource", {})
        entry = {
            "TrainingInputMode": channel.get("InputMode") or job_mode,
            "S3DistributionType": source.get("S3DataDistributionType", "FullyReplicated"),
            "RecordWrapperType": channel.get("RecordWrapperType", "None"),
        }
        if channel.get("ContentType"):
            entry["ContentType"] = channel["ContentType"]
        found[channel["ChannelName"]] = entry
    return found


def threads_per_rank(cpus: int, ranks_running: int) -> int:
    """OMP threads per rank so that every running rank together uses at most the CPUs (at least one)."""
    return max(1, cpus // max(1, ranks_running))


def keys_for_host(keys: Sequence[str], distribution: str, host_index: int, hosts: int) -> list[str]:
    """The S3 keys host `host_index` (0-based) gets: all (FullyReplicated), or every hosts-th of the
    sorted keys (ShardedByS3Key)."""
    ordered = sorted(keys)
    if distribution == "ShardedByS3Key":
        return ordered[host_index::hosts]
    return ordered


def relative_key(key: str, prefix: str) -> str:
    """Where an object of an S3Prefix lands below the channel folder: its key after the prefix's folder."""
    base = prefix if prefix.endswith("/") or not prefix else prefix.rsplit("/", 1)[0] + "/"
    if "/" not in prefix:
        base = ""
    return key[len(base) :].lstrip("/")


def split_s3_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


@dataclass
class MetricScanner:
    """MetricDefinitions applied to log lines as SageMaker does: each regex searched in each line, its
    first group the value (finite numbers only)."""

    definitions: Sequence[Mapping[str, str]]
    final: dict[str, tuple[float, datetime]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._compiled = []
        for definition in self.definitions:
            try:
                self._compiled.append((definition["Name"], re.compile(definition["Regex"])))
            except (KeyError, re.error):
                continue  # SageMaker would have refused the request; nothing to scan with

    def scan(self, line: str, when: datetime) -> list[tuple[str, float]]:
        found = []
        for name, pattern in self._compiled:
            match = pattern.search(line)
            if not match:
                continue
            try:
                value = float(match.group(1) if pattern.groups else match.group(0))
            except (ValueError, IndexError):
                continue
            if not math.isfinite(value):
                continue
            found.append((name, value))
            self.final[name] = (value, when)
        return found

    def final_metric_data_list(self) -> list[dict[str, Any]]:
        return [{"MetricName": n, "Value": v, "Timestamp": t} for n, (v, t) in sorted(self.final.items())]


# PutLogEvents (CloudWatch Logs API reference): at most 10,000 events and 1,048,576 bytes a batch, counted
# as each message's UTF-8 bytes plus 26; one event at most 256 KiB (a longer line is cut, as the agent does).
LOG_BATCH_EVENTS = 10_000
LOG_BATCH_BYTES = 1_048_576
LOG_EVENT_OVERHEAD = 26
LOG_EVENT_MAX = 256 * 1024 - LOG_EVENT_OVERHEAD


def log_batches(events: Sequence[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
    """`events` (timestamp, message) in PutLogEvents batches within its documented limits."""
    batches: list[list[dict[str, Any]]] = []
    size = 0
    for event in events:
        message = event["message"].encode("utf-8")[:LOG_EVENT_MAX].decode("utf-8", "ignore") or " "
        cost = len(message.encode("utf-8")) + LOG_EVENT_OVERHEAD
        if not batches or len(batches[-1]) >= LOG_BATCH_EVENTS or size + cost > LOG_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append({"timestamp": event["timestamp"], "message": message})
        size += cost
    return batches


def inherited_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith(NOT_INHERITED)}


def tracking_uri_for_job(value: str | None, mlflow_url: str | None) -> str | None:
    """The job's MLFLOW_TRACKING_URI in the emulator: an MLflow ARN (a placeholder here) becomes the
    emulator's MLflow server, or nothing when it has none; a URL is kept."""
    if value and value.startswith("arn:"):
        return mlflow_url or None
    return value


# --- The job runner -------------------------------------------------------------------------------


def _clients(*services: str) -> list[Any]:
    import boto3

    from trainstack.emulator.endpoint import CREDENTIALS

    session = boto3.session.Session(
        region_name=SETTINGS.region,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=CREDENTIALS["AWS_SESSION_TOKEN"],
    )
    return [session.client(s, endpoint_url=SETTINGS.endpoint) for s in services]


def _mlflow_url() -> str | None:
    if SETTINGS.mlflow_url:
        return SETTINGS.mlflow_url
    from trainstack.emulator.endpoint import read_state

    state = read_state() or {}
    return state.get("mlflow") if isinstance(state.get("mlflow"), str) else None


def ranks_running() -> int:
    with _LOCK:
        return sum(job.ranks for job in _RUNNING.values() if job.ranks)


def running_job(name: str) -> LocalJob | None:
    with _LOCK:
        return _RUNNING.get(name)


@dataclass
class Node:
    host: str
    root: Path  # stands in for /opt/ml
    log_path: Path
    stream: str
    process: subprocess.Popen | None = None
    pending: list[dict[str, Any]] = field(default_factory=list)
    reader: threading.Thread | None = None


class LocalJob:
    """One job run as local processes (a thread of the server). `kind`: "training" or "processing"."""

    def __init__(
        self, kind: str, job: Any, request: Mapping[str, Any], change_status: Callable[..., None]
    ) -> None:
        self.kind, self.job, self.request = kind, job, dict(request)
        self.change_status = change_status  # trainstack.emulator.events.change_job_status
        self.name: str = job.training_job_name if kind == "training" else job.processing_job_name
        self.stop_reason: str | None = None  # "Stopped" or "MaxRuntimeExceeded" once asked to stop
        self.killed = False  # ended by hand (events.end_job): no status of its own
        self.ranks = 0
        self.nodes: list[Node] = []
        self.metrics = MetricScanner(
            (request.get("AlgorithmSpecification") or {}).get("MetricDefinitions") or []
        )
        self._metric_data: list[dict[str, Any]] = []
        self._lines = threading.Lock()
        self.directory = SETTINGS.jobs_dir / self.name
        self.thread = threading.Thread(target=self._main, name=f"job-{self.name}", daemon=True)

    # --- control, from the API handlers ---
    def stop(self, reason: str = "Stopped") -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def kill(self) -> None:
        """Ended by hand (a test's end_training_job): kill the processes, change no status."""
        self.mark_killed()
        _kill_trees(self.processes())

    def mark_killed(self) -> None:
        """From now on no status change: the job's processes are being killed, not ended by the job.
        `killed` is set first: the job's thread, seeing `stop_reason`, then already sees it too."""
        self.killed = True
        self.stop_reason = self.stop_reason or "Stopped"

    def processes(self) -> list[subprocess.Popen | None]:
        return [node.process for node in self.nodes]

    # --- the job's life ---
    def _status(self, status: str, secondary: str | None, message: str) -> None:
        if self.killed:
            return
        if self.kind == "processing" and status in ("Completed", "Failed", "Stopped"):
            # ExitMessage: each container's /opt/ml/output/message, concatenated, the first 1 KB
            # (developer guide, "Save and Access Metadata Information About Your Processing Job").
            message = self._exit_message()
        self.change_status(self.job, status, secondary, message)

    def _exit_message(self) -> str:
        parts = []
        for node in self.nodes:
            path = node.root / "output" / "message"
            if path.is_file():
                parts.append(path.read_text(encoding="utf-8", errors="replace"))
        return "".join(parts)[:FAILURE_REASON_MAX]

    def _main(self) -> None:
        try:
            self._run()
        except Exception as error:  # the emulator's own fault: the job fails, the server lives on
            import traceback

            traceback.print_exc()
            self._fail(
                f"InternalServerError: the emulator could not run the job: {error}"[:FAILURE_REASON_MAX]
            )
        finally:
            _kill_trees(self.processes())
            self._discard_copies()
            with _LOCK:
                _RUNNING.pop(self.name, None)

    def _discard_copies(self) -> None:
        """Delete what this job copied from S3 once it has ended (on SageMaker the instance and its disk
        go away): each node's input channels (File and FastFile copies, a base model's included) and,
        when it went back to S3, the restored checkpoint folder (LocalPath). The token data alone made
        420 MB for 42 tiny jobs. Kept, as a user needs them: the node's log, its config files,
        output/failure and message, model/ and output/data (uploaded too)."""
        import shutil

        spec = getattr(self, "_spec_used", None)
        if spec is None:
            return
        checkpoint = spec.get("checkpoint") if getattr(self, "_uploaded", False) else None
        for node in self.nodes:
            copies = [Path(map_opt_ml(item["local"], node.root)) for item in spec["inputs"]]
            if checkpoint:
                copies.append(
                    Path(map_opt_ml(checkpoint.get("LocalPath") or "/opt/ml/checkpoints", node.root))
                )
            for copy in copies:
                # Only under the node's own folder: a LocalPath outside it is the container's business.
                if copy.is_dir() and copy.resolve().is_relative_to(node.root.resolve()):
                    shutil.rmtree(copy, ignore_errors=True)

    def _fail(self, reason: str) -> None:
        if self.killed:
            return
        self.job.failure_reason = reason
        self._status("Failed", "Failed", reason)

    def _run(self) -> None:
        spec = self._spec()
        self.directory.mkdir(parents=True, exist_ok=True)
        epoch = int(time.time())
        count = int(spec["instance_count"])
        hosts = host_names(count)
        log_group = TRAINING_LOG_GROUP if self.kind == "training" else PROCESSING_LOG_GROUP
        self.nodes = [
            Node(h, self.directory / h, self.directory / f"{h}.log", f"{self.name}/{h}-{epoch}")
            for h in hosts
        ]
        (logs,) = _clients("logs")
        try:
            logs.create_log_group(logGroupName=log_group)
        except logs.exceptions.ResourceAlreadyExistsException:
            pass
        for node in self.nodes:
            logs.create_log_stream(logGroupName=log_group, logStreamName=node.stream)
        self._log_group, self._logs = log_group, logs

        hyper, ranks, notes = self._hyperparameters(spec, count)
        if notes and any(i["name"] == BASE_CHANNEL for i in spec["inputs"]):
            # The stand-in drops model.init_from (a base model's weights do not fit its shape), so the
            # base model's channel is not copied: it would be read by nothing, and its placeholder bucket
            # (a README's s3://example-base-models/...) need not exist in the emulator.
            spec = {
                **spec,
                "inputs": [i for i in spec["inputs"] if i["name"] != BASE_CHANNEL],
                "channels": [c for c in spec["channels"] if c.get("ChannelName") != BASE_CHANNEL],
            }
            notes = [*notes, f"the stand-in reads no base model: channel '{BASE_CHANNEL}' not copied"]
        self._spec_used = spec  # what the job copies, for _discard_copies when it ends
        if self.stop_reason:
            return self._end_stopped()
        for note in notes:
            self._emit_all(f"EMULATOR: {note}")
        now = datetime.now(UTC)
        if self.kind == "training":
            self.job.training_start_time = now
        else:
            self.job.processing_start_time = now
        started = time.monotonic()
        if spec["inputs"] or spec.get("checkpoint"):
            self._status("InProgress", "Downloading", "Downloading input data")
        try:
            for index, node in enumerate(self.nodes):
                self._prepare_node(spec, node, index, hosts, hyper)
        except (*ClientErrorLike, OSError, RuntimeError) as error:  # SageMaker reports a client error
            return self._fail(f"ClientError: Data download failed: {error}"[:FAILURE_REASON_MAX])
        if self.stop_reason:
            return self._end_stopped()
        # Only the image's entry point starts ranks (torchrun); any other command is one process a node.
        image = spec["command"][1:3] == list(IMAGE_ENTRYPOINT[1:3])
        ranks = ranks if image else 1
        others = ranks_running()  # the other local jobs' ranks (this one's is not counted yet)
        self.ranks = ranks * count
        threads = threads_per_rank(SETTINGS.cpus, others + self.ranks)
        self._status(
            "InProgress",
            "Training",
            "Training image download completed. Training in progress." + (f" {notes[0]}" if notes else ""),
        )
        rendezvous = f"127.0.0.1:{_free_port()}"
        for node in self.nodes:
            env = self._node_environment(spec, node, hosts, hyper, ranks, threads, rendezvous)
            command = [map_opt_ml(part, node.root) for part in spec["command"]]
            shape = f"{ranks} rank(s), {threads} thread(s) each" if image else f"{threads} thread(s)"
            self._emit(node, f"EMULATOR: {node.host}: {' '.join(command)} ({shape})")
            node.process = subprocess.Popen(
                command,
                cwd=node.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: SIGKILL reaches torchrun's workers too
            )
            node.reader = threading.Thread(target=self._read, args=(node,), daemon=True)
            node.reader.start()
        signalled_at: float | None = None
        last_flush = time.monotonic()
        max_runtime = spec.get("max_runtime_s")
        while any(n.process.poll() is None for n in self.nodes if n.process):
            if self.stop_reason is None and max_runtime and time.monotonic() - started > max_runtime:
                self.stop_reason = "MaxRuntimeExceeded"
                self._status("Stopping", "Stopping", "Stopping the job: MaxRuntimeInSeconds reached")
            # A job being killed (mark_killed sets stop_reason too) is not also asked to stop: a SIGTERM
            # here could end a node's entry point before the killer has found the processes below it,
            # and a worker in a session of its own (torchrun's) would then outlive the job as an orphan.
            if self.stop_reason and signalled_at is None and not self.killed:
                signalled_at = time.monotonic()
                for node in self.nodes:
                    _signal(node.process, signal.SIGTERM)
            if signalled_at is not None and time.monotonic() - signalled_at > SETTINGS.kill_after_s:
                _kill_trees(self.processes())
            if time.monotonic() - last_flush > FLUSH_S:
                self._flush()
                last_flush = time.monotonic()
            time.sleep(POLL_S)
        for node in self.nodes:  # every node's entry point has exited: read the rest of its output
            if node.reader is not None:
                node.reader.join(timeout=10)
        codes = [n.process.returncode for n in self.nodes if n.process]
        self._flush()
        if self.killed:
            return None
        if self.stop_reason:
            # still Stopping while what the container saved in its SIGTERM window is uploaded
            self._status("Stopping", "Uploading", "Uploading generated training model")
            self._upload(spec)
            return self._end_stopped()
        if any(codes):
            return self._fail(self._failure_reason(codes))
        if self.kind == "training":
            self._status("InProgress", "Uploading", "Uploading generated training model")
        self._upload(spec)
        self._flush()
        self._status("Completed", "Completed", f"{self.kind.capitalize()} job completed")
        return None

    def _end_stopped(self) -> None:
        if self.killed:
            return
        secondary = self.stop_reason or "Stopped"
        message = (
            f"{self.kind.capitalize()} job stopped: MaxRuntimeInSeconds reached"
            if secondary == "MaxRuntimeExceeded"
            else f"{self.kind.capitalize()} job stopped"
        )
        if self.kind == "training" and self.job.training_job_status != "Stopping":
            self._status("Stopping", "Stopping", "Stopping the training job")
        self._status("Stopped", secondary, message)

    def _failure_reason(self, codes: list[int]) -> str:
        for node in self.nodes:
            failure = node.root / "output" / "failure"
            if failure.is_file() and failure.read_text().strip():
                return failure.read_text().strip()[:FAILURE_REASON_MAX]
        host, code = next((n.host, c) for n, c in zip(self.nodes, codes, strict=True) if c)
        what = "killed by signal " + str(-code) if code < 0 else f"exit code {code}"
        return f"AlgorithmError: the container on {host} ended with {what} (no /opt/ml/output/failure)"

    # --- the request, as the runner needs it ---
    def _spec(self) -> dict[str, Any]:
        r = self.request
        if self.kind == "training":
            algorithm = r.get("AlgorithmSpecification") or {}
            resources = r.get("ResourceConfig") or {}
            channels = r.get("InputDataConfig") or []
            inputs = [
                {
                    "name": c["ChannelName"],
                    "uri": c["DataSource"]["S3DataSource"]["S3Uri"],
                    "type": c["DataSource"]["S3DataSource"].get("S3DataType", "S3Prefix"),
                    "distribution": c["DataSource"]["S3DataSource"].get(
                        "S3DataDistributionType", "FullyReplicated"
                    ),
                    "local": f"/opt/ml/input/data/{c['ChannelName']}",
                    "mode": c.get("InputMode") or algorithm.get("TrainingInputMode", "File"),
                }
                for c in channels
                if "S3DataSource" in c.get("DataSource", {})
            ]
            checkpoint = r.get("CheckpointConfig") or None
            return {
                "command": container_command(algorithm),
                "instance_count": resources.get("InstanceCount", 1),
                "instance_type": resources.get("InstanceType", "ml.m5.large"),
                "inputs": inputs,
                "channels": channels,
                "input_mode": algorithm.get("TrainingInputMode", "File"),
                "checkpoint": checkpoint,
                "max_runtime_s": _capped_runtime(
                    (r.get("StoppingCondition") or {}).get("MaxRuntimeInSeconds")
                ),
                "environment": dict(r.get("Environment") or {}),
                "fault_inject": SETTINGS.fault_inject,
                "hyperparameters": dict(r.get("HyperParameters") or {}),
                "output": (r.get("OutputDataConfig") or {}).get("S3OutputPath"),
                "tensorboard": r.get("TensorBoardOutputConfig") or None,
                "outputs": [],
            }
        app = r.get("AppSpecification") or {}
        cluster = (r.get("ProcessingResources") or {}).get("ClusterConfig") or {}
        inputs = []
        for item in r.get("ProcessingInputs") or []:
            source = item.get("S3Input")
            if source:
                inputs.append(
                    {
                        "name": item["InputName"],
                        "uri": source["S3Uri"],
                        "type": source.get("S3DataType", "S3Prefix"),
                        "distribution": source.get("S3DataDistributionType", "FullyReplicated"),
                        "local": source["LocalPath"],
                        "mode": source.get("S3InputMode", "File"),
                    }
                )
        outputs = [
            {"local": o["S3Output"]["LocalPath"], "uri": o["S3Output"]["S3Uri"]}
            for o in (r.get("ProcessingOutputConfig") or {}).get("Outputs") or []
            if "S3Output" in o
        ]
        return {
            "command": container_command(
                {
                    "ContainerEntrypoint": app.get("ContainerEntrypoint"),
                    "ContainerArguments": app.get("ContainerArguments"),
                }
            ),
            "instance_count": cluster.get("InstanceCount", 1),
            "instance_type": cluster.get("InstanceType", "ml.m5.large"),
            "inputs": inputs,
            "channels": [],
            "input_mode": "File",
            "checkpoint": None,
            "max_runtime_s": (r.get("StoppingCondition") or {}).get("MaxRuntimeInSeconds"),
            "environment": dict(r.get("Environment") or {}),
            "hyperparameters": {},
            "output": None,
            "tensorboard": None,
            "outputs": outputs,
        }

    def _hyperparameters(self, spec: dict[str, Any], nodes: int) -> tuple[dict[str, str], int, list[str]]:
        """The hyperparameters the container gets, its ranks per node, and what to say about them."""
        hyper = spec["hyperparameters"]
        if self.kind != "training":
            return hyper, 1, []
        from trainstack.emulator import stand_in

        decided = stand_in.for_job(hyper, nodes, SETTINGS.ranks_per_node, spec["command"])
        if decided.note:
            self.job.environment = {
                **(getattr(self.job, "environment", None) or {}),
                STAND_IN_ENV: decided.note,
            }
        return decided.hyperparameters, decided.ranks_per_node, [decided.note] if decided.note else []

    def _prepare_node(
        self, spec: dict[str, Any], node: Node, index: int, hosts: list[str], hyper: Mapping[str, str]
    ) -> None:
        root = node.root
        for folder in ("input/config", "input/data", "model", "output/data", "checkpoints", "code"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        (root / "output" / "failure").unlink(missing_ok=True)
        (root / "output" / "message").unlink(missing_ok=True)
        config_dir = root / ("input/config" if self.kind == "training" else "config")
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "resourceconfig.json").write_text(
            json.dumps(resource_config(node.host, hosts, spec["instance_type"]))
        )
        if self.kind == "training":
            (config_dir / "hyperparameters.json").write_text(json.dumps(dict(hyper)))
            (config_dir / "inputdataconfig.json").write_text(
                json.dumps(input_data_config(spec["channels"], spec["input_mode"]))
            )
        else:
            (config_dir / "processingjobconfig.json").write_text(json.dumps(self.request, default=str))
        (s3,) = _clients("s3")
        for item in spec["inputs"]:
            if item["type"] != "S3Prefix":
                raise RuntimeError(
                    f"input {item['name']}: S3DataType {item['type']} is not emulated (S3Prefix only)"
                )
            target = Path(map_opt_ml(item["local"], root))
            copied = _download_prefix(s3, item["uri"], target, item["distribution"], index, len(hosts))
            self._emit(
                node, f"EMULATOR: {item['mode']} input {item['name']}: {copied} object(s) from {item['uri']}"
            )
        checkpoint = spec.get("checkpoint")
        if checkpoint:
            local = Path(map_opt_ml(checkpoint.get("LocalPath") or "/opt/ml/checkpoints", root))
            _download_prefix(s3, checkpoint["S3Uri"], local, "FullyReplicated", 0, 1)

    def _node_environment(
        self,
        spec: dict[str, Any],
        node: Node,
        hosts: list[str],
        hyper: Mapping[str, str],
        ranks: int,
        threads: int,
        rendezvous: str,
    ) -> dict[str, str]:
        from trainstack.emulator.endpoint import CREDENTIALS

        root = node.root
        env = inherited_environment(os.environ)
        job_env = {k: str(v) for k, v in spec["environment"].items()}
        tracking = tracking_uri_for_job(job_env.get("MLFLOW_TRACKING_URI"), _mlflow_url())
        job_env.pop("MLFLOW_TRACKING_URI", None)
        if tracking:
            job_env["MLFLOW_TRACKING_URI"] = tracking
        channels = [i["name"] for i in spec["inputs"]]
        env.update(
            {
                **CREDENTIALS,
                "AWS_ENDPOINT_URL": SETTINGS.endpoint,
                "AWS_REGION": SETTINGS.region,
                "AWS_DEFAULT_REGION": SETTINGS.region,
                "AWS_EC2_METADATA_DISABLED": "true",
                "PYTHONUNBUFFERED": "1",  # the image's ENV: log lines reach the log as printed
                OPT_ML_ENV: str(root),
                "TRAINSTACK_NPROC_PER_NODE": str(ranks),
                "OMP_NUM_THREADS": str(threads),
                "MKL_NUM_THREADS": str(threads),
                "SM_CURRENT_HOST": node.host,
                "SM_HOSTS": json.dumps(hosts),
                "SM_NUM_GPUS": "0",
                "SM_NUM_CPUS": str(threads * ranks),
                "SM_CURRENT_INSTANCE_TYPE": spec["instance_type"],
                "SM_NETWORK_INTERFACE_NAME": loopback_interface(),
                "SM_INPUT_DIR": str(root / "input"),
                "SM_INPUT_CONFIG_DIR": str(root / "input" / "config"),
                "SM_OUTPUT_DIR": str(root / "output"),
                "SM_OUTPUT_DATA_DIR": str(root / "output" / "data"),
                "SM_MODEL_DIR": str(root / "model"),
                "SM_CHANNELS": json.dumps(channels),
                "SM_HPS": json.dumps(dict(hyper)),
            }
        )
        if len(hosts) > 1:
            env["TRAINSTACK_RENDEZVOUS"] = rendezvous
        if self.kind == "training":
            env.update({"TRAINING_JOB_NAME": self.name, "TRAINING_JOB_ARN": self.job.arn})
            for item in spec["inputs"]:
                env[f"SM_CHANNEL_{item['name'].upper()}"] = map_opt_ml(item["local"], root)
        else:
            env.update({"PROCESSING_JOB_NAME": self.name, "PROCESSING_JOB_ARN": self.job.arn})
        env.update(job_env)  # the request's Environment wins, as on SageMaker
        if spec.get("fault_inject"):
            env[FAULT_INJECT_ENV] = spec["fault_inject"]
        env.update({OPT_ML_ENV: str(root), "AWS_ENDPOINT_URL": SETTINGS.endpoint})
        return env

    # --- logs and metrics ---
    def _read(self, node: Node) -> None:
        assert node.process is not None and node.process.stdout is not None
        with node.log_path.open("a", encoding="utf-8") as log:
            for raw in node.process.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                self._record(node, line)

    def _emit(self, node: Node, line: str) -> None:
        with node.log_path.open("a", encoding="utf-8") as log:
            log.write(line + "\n")
        self._record(node, line)

    def _emit_all(self, line: str) -> None:
        for node in self.nodes:
            self._emit(node, line)

    def _record(self, node: Node, line: str) -> None:
        now = datetime.now(UTC)
        with self._lines:
            node.pending.append({"timestamp": int(now.timestamp() * 1000), "message": line or " "})
            for name, value in self.metrics.scan(line, now):
                self._metric_data.append(
                    {
                        "MetricName": name,
                        "Dimensions": [{"Name": METRIC_DIMENSION, "Value": self.name}],
                        "Timestamp": now,
                        "Value": value,
                    }
                )

    def _flush(self) -> None:
        with self._lines:
            batches = [(n.stream, n.pending) for n in self.nodes if n.pending]
            for node in self.nodes:
                node.pending = []
            metric_data, self._metric_data = self._metric_data, []
        for stream, events in batches:
            for batch in log_batches(events):
                self._logs.put_log_events(logGroupName=self._log_group, logStreamName=stream, logEvents=batch)
        if metric_data and self.kind == "training":
            (cloudwatch,) = _clients("cloudwatch")
            for start in range(0, len(metric_data), 20):
                cloudwatch.put_metric_data(
                    Namespace=METRICS_NAMESPACE, MetricData=metric_data[start : start + 20]
                )
        if self.kind == "training" and self.metrics.final:
            self.job.final_metric_data_list = self.metrics.final_metric_data_list()

    # --- outputs ---
    def _upload(self, spec: dict[str, Any]) -> None:
        (s3,) = _clients("s3")
        first = self.nodes[0].root
        checkpoint = spec.get("checkpoint")
        if checkpoint:
            for node in self.nodes:
                local = Path(map_opt_ml(checkpoint.get("LocalPath") or "/opt/ml/checkpoints", node.root))
                _upload_folder(s3, local, checkpoint["S3Uri"])
        self._uploaded = True  # the checkpoint folders are in S3: their local copies may go
        tensorboard = spec.get("tensorboard")
        if tensorboard:
            local = Path(map_opt_ml(tensorboard.get("LocalPath") or "/opt/ml/output/tensorboard", first))
            _upload_folder(s3, local, tensorboard["S3OutputPath"])
        if spec.get("output"):
            prefix = f"{spec['output'].rstrip('/')}/{self.name}/output"
            _put_tar(s3, first / "model", f"{prefix}/model.tar.gz")
            if any((first / "output" / "data").iterdir()):
                _put_tar(s3, first / "output" / "data", f"{prefix}/output.tar.gz")
        for output in spec.get("outputs") or []:
            for node in self.nodes:
                _upload_folder(s3, Path(map_opt_ml(output["local"], node.root)), output["uri"])


# --- S3 copies (the emulator's own S3, through its endpoint) ---------------------------------------


def _download_prefix(s3: Any, uri: str, target: Path, distribution: str, host: int, hosts: int) -> int:
    bucket, prefix = split_s3_uri(uri)
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [item["Key"] for item in page.get("Contents", []) if not item["Key"].endswith("/")]
    mine = keys_for_host(keys, distribution, host, hosts)
    target.mkdir(parents=True, exist_ok=True)
    for key in mine:
        path = target / relative_key(key, prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, key, str(path))
    return len(mine)


def _upload_folder(s3: Any, folder: Path, uri: str) -> None:
    if not folder.is_dir():
        return
    bucket, prefix = split_s3_uri(uri)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            key = f"{prefix.rstrip('/')}/{path.relative_to(folder).as_posix()}".lstrip("/")
            s3.upload_file(str(path), bucket, key)


def _put_tar(s3: Any, folder: Path, uri: str) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
    bucket, key = split_s3_uri(uri)
    s3.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())


# --- processes ------------------------------------------------------------------------------------


def _free_port() -> int:
    from trainstack.emulator.endpoint import free_port

    return free_port()


def _signal(process: subprocess.Popen | None, signum: int) -> None:
    if process is not None and process.poll() is None:
        try:
            process.send_signal(signum)
        except ProcessLookupError:
            pass


def descendants(pid: int, parents: Mapping[int, int]) -> list[int]:
    """Every process below `pid` in the tree `parents` (child -> parent), children before grandchildren."""
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _process_parents() -> dict[int, int]:
    """child -> parent for every process: from /proc on Linux (no process to start, which matters when
    the server is being stopped on a loaded machine), else `ps` (macOS)."""
    proc = Path("/proc")
    if proc.is_dir():
        parents = {}
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 1 and fields[1].isdigit():
                parents[int(entry.name)] = int(fields[1])
        return parents
    try:
        listed = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    parents = {}
    for line in listed.stdout.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            parents[int(fields[0])] = int(fields[1])
    return parents


def _kill_trees(processes: Sequence[subprocess.Popen | None]) -> None:
    """SIGKILL each node's whole process tree: its process group (the entry point, torchrun) and every
    descendant, which matters because torchrun starts each worker in a session of its own. All trees at
    once: a server being stopped has seconds, not one process-table scan per node."""
    roots = [p.pid for p in processes if p is not None and p.poll() is None]  # exited and reaped: its PID
    if not roots:  # may belong to another process by now
        return
    # Freeze the trees first (SIGSTOP), looking again until no new process appears, so nothing forked
    # meanwhile escapes as an orphan; then SIGKILL all of it.
    frozen: list[int] = []
    for _ in range(5):
        parents = _process_parents()
        tree = [*roots, *(pid for root in roots for pid in descendants(root, parents))]
        new = [p for p in tree if p not in frozen]
        if not new:
            break
        for pid in new:
            _send(pid, signal.SIGSTOP)
        frozen += new
    for pid in frozen:
        _send(pid, signal.SIGKILL, group=True)


def _send(pid: int, signum: int, group: bool = False) -> None:
    for send in (os.killpg, os.kill) if group else (os.kill,):
        try:
            send(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def kill_all() -> None:
    """SIGKILL every running job's processes (the server is going: no job outlives its emulator)."""
    with _LOCK:
        running = list(_RUNNING.values())
    for runner in running:
        runner.mark_killed()
    _kill_trees([process for runner in running for process in runner.processes()])


# --- entry points for the server's handlers -------------------------------------------------------


def start_training_job(job: Any, request: Mapping[str, Any], change_status: Callable[..., None]) -> LocalJob:
    """Run training job `job` (moto's) for `request` (CreateTrainingJob's); every status change through
    `change_status(job, status, secondary, message)` (trainstack.emulator.events.change_job_status)."""
    runner = LocalJob("training", job, request, change_status)
    with _LOCK:
        _RUNNING[runner.name] = runner
    runner.thread.start()
    return runner


def start_processing_job(
    job: Any, request: Mapping[str, Any], change_status: Callable[..., None]
) -> LocalJob:
    """As `start_training_job`, for a CreateProcessingJob request."""
    runner = LocalJob("processing", job, request, change_status)
    with _LOCK:
        _RUNNING[runner.name] = runner
    runner.thread.start()
    return runner
