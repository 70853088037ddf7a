"""SageMaker container entrypoint: start torchrun on this node for every GPU, across all hosts.

SageMaker starts the container as `<ENTRYPOINT> train` on every host and writes
/opt/ml/input/config/resourceconfig.json ({"current_host": "algo-2", "hosts": ["algo-1", ...],
"network_interface_name": "eth0"}). This builds one torchrun command per node: nnodes = hosts,
8 processes per node (one per GPU), node rank = position of current_host, rendezvous on the first
host (algo-1); a single host runs --standalone. Then it runs the trainer under it, which reads the
recipe from /opt/ml/input/config/hyperparameters.json.

Environment added (not overriding what the job sets): FI_EFA_USE_HUGE_PAGE=0 (EFA with current
libfabric/aws-ofi-nccl needs only this), PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (allocator
fragmentation OOMs seen on B200), NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME from resourceconfig (the
interface for NCCL's bootstrap and for the gloo group the trainer's checkpointing uses; gloo would
otherwise pick whatever interface the host name resolves to). On several hosts, unless the job sets
NCCL_DEBUG itself: NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET and a per-process NCCL_DEBUG_FILE,
which the trainer's comms gate (trainer.distributed.comms) reads to check that NCCL runs over EFA.
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT is not set: torchrun reads it only from torch 2.11, newer than the
base image's.)

SIGTERM (stop, spot reclaim, max runtime; SageMaker kills 120 s later) is for the trainer processes,
never for torchrun: they save a checkpoint and exit 0, torchrun then sees a clean finish and exits 0,
and so does the container. The entrypoint forwards a SIGTERM it receives to torchrun's workers (also
to workers that start after it, so a stop during start-up is not lost), and torchrun is started with
SIGTERM blocked, so a SIGTERM that reaches it too (a signal to the container's whole process tree)
stays pending and unseen. Were torchrun to handle it, its elastic agent would forward it to the
workers, SIGKILL them after its shutdown timeout (30 s on the base image's torch, whatever the save
still needs) and exit 1 even after a good save, failing the job. The block is inherited by the
workers (it survives fork and exec); the trainer unblocks SIGTERM as soon as its handler is set
(trainer.runtime.stopping.StopRequest). A SIGTERM sent to torchrun alone is therefore ignored: SageMaker
signals the container's first process, which is this one.

The local emulator (trainstack.emulator.jobs) runs this same entrypoint as each "node" of a job, a plain
process on one machine. Where no SageMaker host exists it sets (nothing sets them on SageMaker):
TRAINSTACK_OPT_ML, the directory standing in for /opt/ml (trainstack.protocol.container);
TRAINSTACK_NPROC_PER_NODE, the processes per node (CPU ranks there; default: the CUDA device count, else
8); TRAINSTACK_RENDEZVOUS, `address:port` of the rendezvous (default: the first host, algo-1, on
RENDEZVOUS_PORT, as on SageMaker, where algo-1 resolves to the first node).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.distributed.comms import NCCL_DEBUG_FILE, NCCL_LOG_DIR
from trainer.runtime.failure import failure_file, report_failure, run_reporting
from trainstack.protocol import exit_codes
from trainstack.protocol.container import opt_ml
from trainstack.protocol.failures import TRANSIENT

RESOURCE_CONFIG = opt_ml("input/config/resourceconfig.json")  # under $TRAINSTACK_OPT_ML in the emulator
RENDEZVOUS_PORT = 29500
GPUS_PER_NODE_DEFAULT = 8
FORWARD_POLL_S = 0.5  # how soon a worker that starts after a SIGTERM gets it too
NPROC_ENV = "TRAINSTACK_NPROC_PER_NODE"
RENDEZVOUS_ENV = "TRAINSTACK_RENDEZVOUS"


@dataclass(frozen=True)
class ResourceConfig:
    current_host: str
    hosts: tuple[str, ...]
    network_interface_name: str | None = None

    @property
    def node_rank(self) -> int:
        return self.hosts.index(self.current_host)


class EntrypointError(Exception):
    pass


def read_resource_config(path: Path) -> ResourceConfig:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EntrypointError(f"{path}: not found (is this running in a SageMaker training job?)") from None
    except json.JSONDecodeError as exc:
        raise EntrypointError(f"{path}: not valid JSON ({exc.msg})") from None
    hosts = data.get("hosts")
    current = data.get("current_host")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise EntrypointError(f"{path}: hosts: expected a non-empty list of host names")
    if current not in hosts:
        raise EntrypointError(f"{path}: current_host: {current!r} is not one of hosts {hosts}")
    # SageMaker lists algo-1..algo-N; sort so every node agrees on the order whatever the file says.
    ordered = tuple(sorted(hosts, key=lambda h: (len(h), h)))
    return ResourceConfig(current, ordered, data.get("network_interface_name"))


def gpus_per_node() -> int:
    if os.environ.get(NPROC_ENV):
        return int(os.environ[NPROC_ENV])
    try:
        import torch

        count = torch.cuda.device_count()
    except ImportError:
        count = 0
    return count or GPUS_PER_NODE_DEFAULT


def build_command(
    config: ResourceConfig,
    nproc_per_node: int,
    trainer_args: list[str],
    python: str = sys.executable,
    port: int = RENDEZVOUS_PORT,
    address: str | None = None,
) -> list[str]:
    command = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if len(config.hosts) == 1:
        command.append("--standalone")
    else:
        command += [
            f"--nnodes={len(config.hosts)}",
            f"--node-rank={config.node_rank}",
            f"--master-addr={address or config.hosts[0]}",
            f"--master-port={port}",
        ]
    return command + ["-m", "trainer", *trainer_args]


def build_environment(config: ResourceConfig, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.setdefault("FI_EFA_USE_HUGE_PAGE", "0")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if config.network_interface_name:
        env.setdefault("NCCL_SOCKET_IFNAME", config.network_interface_name)
        env.setdefault("GLOO_SOCKET_IFNAME", config.network_interface_name)
    if len(config.hosts) > 1 and "NCCL_DEBUG" not in env:
        # What the comms gate reads: INIT and NET lines only, one file per process, off stdout.
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=NCCL_DEBUG_FILE)
    return env


def child_pids(parent: int) -> list[int]:
    """Direct children of `parent`, from /proc (torchrun starts its workers as direct children)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 (ppid) follows the parenthesised command name, which may itself contain spaces.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent:
            children.append(int(entry.name))
    return children


class Forwarder:
    """SIGTERM (or SIGINT) to this process -> SIGTERM to each of torchrun's workers, once each, including
    workers that appear later (call `poll` while waiting)."""

    def __init__(self, torchrun_pid: int):
        self.torchrun_pid = torchrun_pid
        self.requested = False
        self.signalled: set[int] = set()

    def handle(self, signum: int, frame: object) -> None:
        self.requested = True
        print(f"entrypoint: signal {signum}: stopping the trainer", file=sys.stderr, flush=True)
        self.poll()

    def poll(self) -> None:
        if not self.requested:
            return
        for pid in child_pids(self.torchrun_pid):
            if pid in self.signalled:
                continue
            self.signalled.add(pid)
            print(f"entrypoint: forwarding SIGTERM to trainer process {pid}", file=sys.stderr, flush=True)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def run(command: list[str], env: dict[str, str]) -> int:
    # torchrun inherits SIGTERM blocked (see the module docstring); this process blocks it only while
    # starting torchrun, so a SIGTERM in that moment is delivered to `forward` right after.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        process = subprocess.Popen(command, env=env)
        forward = Forwarder(process.pid)
        signal.signal(signal.SIGTERM, forward.handle)
        signal.signal(signal.SIGINT, forward.handle)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    while True:
        try:
            return process.wait(timeout=FORWARD_POLL_S)
        except subprocess.TimeoutExpired:
            forward.poll()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # SageMaker runs the image as `<entrypoint> train`
        argv = argv[1:]
    trainer_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, trainer_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(prog="python -m trainer.entrypoint")
    parser.add_argument("--resource-config", type=Path, default=RESOURCE_CONFIG)
    parser.add_argument("--nproc-per-node", type=int, default=None, help="default: CUDA device count, else 8")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    args = parser.parse_args(argv)
    try:
        config = read_resource_config(args.resource_config)
    except EntrypointError as exc:  # the job's environment: the next job would meet it too
        return report_failure(exit_codes.RECIPE_OR_ENVIRONMENT, str(exc))
    address, _, port = os.environ.get(RENDEZVOUS_ENV, "").rpartition(":")
    command = build_command(
        config,
        args.nproc_per_node or gpus_per_node(),
        trainer_args,
        port=int(port) if port else RENDEZVOUS_PORT,
        address=address or None,
    )
    env = build_environment(config, dict(os.environ))
    print(
        f"entrypoint: host {config.current_host} (node {config.node_rank} of {len(config.hosts)}): "
        f"{' '.join(command)}",
        file=sys.stderr,
        flush=True,
    )
    if args.dry_run:
        added = {k: env[k] for k in sorted(env) if k not in os.environ}
        print(json.dumps({"command": command, "env": added}))
        return 0
    if env.get("NCCL_DEBUG_FILE") == NCCL_DEBUG_FILE:
        Path(NCCL_LOG_DIR).mkdir(parents=True, exist_ok=True)
    code = run(command, env)
    if code != 0:
        explain_silent_end(code)
    return code


def explain_silent_end(code: int) -> None:
    """The trainer's processes ended non-zero: when none of them said why (killed by a signal, the host
    out of memory, a peer's failure that took them down), say so, as possibly transient. Written only
    where no rank wrote a line (write_failure_file keeps the first non-fatal line)."""
    path = failure_file()
    if path is None or path.is_file():
        return
    what = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    exit_codes.write_failure_file(
        path,
        exit_codes.TRANSIENT,
        f"{TRANSIENT}: the trainer's processes on this host ended ({what}) without a reason of their own "
        "(a signal, the host's memory, a lost peer or node); retried by the run's next job",
    )


if __name__ == "__main__":
    sys.exit(run_reporting(main))
