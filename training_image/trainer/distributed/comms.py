"""The comms gate: a multi-node job stops at start unless NCCL really runs over EFA.

Recent NCCL looks for the network plugin `libnccl-net-aws-ofi.so` while some EFA installers name it
`libnccl-net-ofi.so`; NCCL then falls back to TCP sockets without an error, about 23% slower
(NVIDIA/exemplar-performance#39). The same silent fallback follows a missing /dev/infiniband device
or a libfabric that finds no EFA provider. So at start, after one collective, every rank reads the
INIT/NET lines NCCL wrote for it (the entrypoint sets NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET and
a per-process NCCL_DEBUG_FILE for multi-node jobs) and checks that

    NCCL INFO Using network Libfabric             (or "AWS Libfabric": the aws-ofi-nccl plugin)
    NCCL INFO NET/OFI Selected provider is efa    (libfabric's EFA provider, not tcp or sockets)

for every communicator. Any rank that sees otherwise makes every rank stop with one line and exit 4
(`trainstack.protocol.exit_codes.NETWORK`, a `trainstack-fatal` failure: another job of the run would repeat
it). TRAINSTACK_EFA_GATE=off skips the gate (a job on instances without EFA, knowingly).
"""

from __future__ import annotations

import glob
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainstack.errors import TrainstackError
from trainstack.protocol import exit_codes

if TYPE_CHECKING:
    import torch

GATE_SWITCH = "TRAINSTACK_EFA_GATE"
NCCL_LOG_DIR = "/tmp/trainstack-nccl"
# %h and %p are NCCL's own placeholders for the host name and the process id (NCCL docs,
# NCCL_DEBUG_FILE); one file per process, so each rank reads only what NCCL printed for it.
NCCL_DEBUG_FILE = f"{NCCL_LOG_DIR}/nccl.%h.%p.log"
EFA_NETWORKS = frozenset({"Libfabric", "AWS Libfabric"})  # the aws-ofi-nccl plugin's names, new and old
FALLBACK_EXPLANATION = (
    "inter-node collectives would run over TCP sockets, about 23% slower (NVIDIA/exemplar-performance#39)"
)

_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is ([\w.-]+)")
_PLUGIN_PROBLEM = re.compile(
    r"NET/Plugin\s*:?\s*(.*(?:Could not find|cannot open|No plugin found|returned \d|Failed to initialize|"
    r"dlerror).*)$"
)
_DLOPEN_PROBLEM = re.compile(r"ncclOsDlopen\((libnccl-net[^)]*)\) failed: (.*)$")
_OFI_WARN = re.compile(r"NCCL WARN (NET/OFI .*)$")


class CommsGateError(TrainstackError):
    exit_code = exit_codes.NETWORK


@dataclass
class NcclNetwork:
    """What NCCL's INIT/NET lines say about the network it chose (one process's log)."""

    networks: list[str] = field(default_factory=list)  # one "Using network X" per communicator
    providers: list[str] = field(default_factory=list)  # libfabric providers aws-ofi-nccl selected
    plugin_problems: list[str] = field(default_factory=list)  # why a plugin did not load


def parse_nccl_debug(text: str) -> NcclNetwork:
    found = NcclNetwork()
    for line in text.splitlines():
        if match := _USING_NETWORK.search(line):
            found.networks.append(match.group(1))
        elif match := _PROVIDER.search(line):
            found.providers.append(match.group(1).rstrip(",").lower())
        elif match := _DLOPEN_PROBLEM.search(line):
            found.plugin_problems.append(f"{match.group(1)}: {match.group(2).strip()}")
        elif match := _PLUGIN_PROBLEM.search(line):
            found.plugin_problems.append(match.group(1).strip())
        elif match := _OFI_WARN.search(line):
            found.plugin_problems.append(match.group(1).strip())
    return found


def efa_problem(found: NcclNetwork) -> str | None:
    """None when every communicator uses aws-ofi-nccl over libfabric's EFA provider; else why not."""
    if not found.networks:
        return "NCCL logged no 'Using network' line (is NCCL_DEBUG_SUBSYS missing INIT?)"
    others = sorted(set(found.networks) - EFA_NETWORKS)
    if others:
        why = "; ".join(dict.fromkeys(found.plugin_problems)) or "the aws-ofi-nccl plugin did not load"
        return f"NCCL uses network {', '.join(others)}, not the aws-ofi-nccl plugin ({why})"
    providers = sorted(set(found.providers))
    if providers != ["efa"]:
        seen = ", ".join(providers) if providers else "none logged"
        return f"the aws-ofi-nccl plugin loaded but its libfabric provider is not efa ({seen})"
    return None


def nccl_debug_paths(pattern: str, pid: int) -> list[Path]:
    """The files NCCL_DEBUG_FILE `pattern` names for process `pid` (%h: any host name)."""
    return sorted(Path(p) for p in glob.glob(pattern.replace("%h", "*").replace("%p", str(pid))))


def multi_node() -> bool:
    """Whether torchrun started ranks on more than one node."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def local_problem(environ: dict[str, str], pid: int) -> str | None:
    """This process's verdict from the NCCL log NCCL_DEBUG_FILE names for it (None: over EFA)."""
    pattern = environ.get("NCCL_DEBUG_FILE")
    if environ.get("NCCL_DEBUG", "").upper() not in {"INFO", "TRACE"} or not pattern:
        return "cannot check: needs NCCL_DEBUG=INFO and NCCL_DEBUG_FILE (the entrypoint sets both)"
    paths = nccl_debug_paths(pattern, pid)
    if not paths:
        return f"no NCCL log at {pattern} for process {pid}"
    return efa_problem(parse_nccl_debug("\n".join(p.read_text(errors="replace") for p in paths)))


def decide(verdicts: list[tuple[str, int, str | None]]) -> str:
    """Every rank's (host, rank, problem): the log line if all passed, else the one-line stop."""
    failed = [v for v in verdicts if v[2] is not None]
    if failed:
        host, first_rank, why = failed[0]
        raise CommsGateError(
            f"comms gate: NCCL is not running over EFA on {len(failed)} of {len(verdicts)} ranks "
            f"(first: rank {first_rank} on {host}): {why}; {FALLBACK_EXPLANATION}. Fix the image's "
            f"aws-ofi-nccl plugin (docs/trainer.md, comms gate), or set {GATE_SWITCH}=off to run anyway"
        )
    return f"passed: {len(verdicts)} ranks use aws-ofi-nccl over EFA"


def check_efa(device: torch.device, rank: int, world: int) -> str:
    """Run the gate on every rank (collectively); returns what it decided, for the log."""
    import torch  # here, not at the top: the entrypoint imports this module's constants without torch
    import torch.distributed as dist

    if device.type != "cuda" or not multi_node():
        return "not needed (one node)" if device.type == "cuda" else "not needed (CPU)"
    if os.environ.get(GATE_SWITCH, "").lower() in {"off", "0", "false"}:
        return f"skipped ({GATE_SWITCH}=off)"
    # One collective so every communicator is initialised and its transport chosen and logged.
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    torch.cuda.synchronize(device)
    mine = (socket.gethostname(), rank, local_problem(dict(os.environ), os.getpid()))
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, mine)
    return decide(verdicts)
