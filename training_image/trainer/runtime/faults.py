"""Test-only fault injection: kill the trainer at an exact phase of a save, or make a SIGTERM late.

TRAINSTACK_FAULT_INJECT is for the fault tests (tests/trainer/test_trainer_faults.py) and nothing
else; no launcher, recipe or image sets it. Unset, every hook below is one comparison with None.

    kill:<phase>[@<step>][#<rank>]   SIGKILL this process when the save of <step> (any step if
                                     omitted) reaches <phase> on <rank> (any rank if omitted)
    sigterm-no-time                  a SIGTERM counts as arriving with no time left to save
    sigterm-at-start                 the trainer signals itself SIGTERM as soon as its handler is set
                                     (a stop that lands while the job is still starting)
    nan-gradients@<step>             the gradients of optimizer step <step> become NaN before clipping,
                                     as a diverging run's do (recipe bounds keep an lr that diverges on
                                     purpose out of reach)
    oom@<step>                       optimizer step <step>'s forward raises torch.OutOfMemoryError, as a
                                     layout too big for the GPU does (the tuning tests on CPU)
    raise:<Error>@<step>             optimizer step <step>'s forward raises <Error>, uncaught: TypeError
                                     (a bug in the code), FileNotFoundError (a missing resource) or
                                     ConnectionResetError (a lost peer), for the failure line's classes
                                     (trainstack.protocol.failures) through whole runs

Phases, in the order a save passes them (trainer.checkpoint.manager): before-shards (rank-N.pt written, no
shard yet), mid-shards (the first bytes of a shard written, the shard not finished), after-shards
(DCP returned: every shard and .metadata written), after-manifests (every rank's manifest written),
before-marker (rank 0 about to write COMPLETE.json), after-marker (COMPLETE.json written).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from dataclasses import dataclass

from trainstack.errors import TrainstackError

ENV = "TRAINSTACK_FAULT_INJECT"
PHASES = ("before-shards", "mid-shards", "after-shards", "after-manifests", "before-marker", "after-marker")
ACTIONS = ("sigterm-no-time", "sigterm-at-start")
_NAN = re.compile(r"^nan-gradients@(?P<step>\d+)$")
_OOM = re.compile(r"^oom@(?P<step>\d+)$")
_RAISE = re.compile(r"^raise:(?P<error>[A-Za-z]+)@(?P<step>\d+)$")
# The errors `raise:` may raise: one of each class of trainstack.protocol.failures.
RAISABLE = {
    "TypeError": TypeError,
    "FileNotFoundError": FileNotFoundError,
    "ConnectionResetError": ConnectionResetError,
}
_KILL = re.compile(r"^kill:(?P<phase>[a-z-]+)(?:@(?P<step>\d+))?(?:#(?P<rank>\d+))?$")


@dataclass(frozen=True)
class Fault:
    action: str  # "kill", "nan-gradients", "oom", "raise" or one of ACTIONS
    phase: str | None = None  # kill: the save's phase; raise: the error's name
    step: int | None = None
    rank: int | None = None


def parse(text: str) -> Fault:
    """One fault from TRAINSTACK_FAULT_INJECT's text; a TrainstackError naming it when it is wrong."""
    if text in ACTIONS:
        return Fault(text)
    if nan := _NAN.match(text):
        return Fault("nan-gradients", step=int(nan["step"]))
    if oom := _OOM.match(text):
        return Fault("oom", step=int(oom["step"]))
    if (raised := _RAISE.match(text)) and raised["error"] in RAISABLE:
        return Fault("raise", raised["error"], int(raised["step"]))
    match = _KILL.match(text)
    if not match or match["phase"] not in PHASES:
        raise TrainstackError(
            f"{ENV}={text!r}: expected kill:<phase>[@<step>][#<rank>] with a phase of {', '.join(PHASES)}, "
            f"nan-gradients@<step>, oom@<step>, raise:<{'|'.join(RAISABLE)}>@<step>, or one of "
            f"{', '.join(ACTIONS)} (test-only)"
        )
    step, rank = match["step"], match["rank"]
    return Fault("kill", match["phase"], int(step) if step else None, int(rank) if rank else None)


def active() -> Fault | None:
    """The injected fault, read afresh (a dictionary lookup when unset). StopRequest reads it at start,
    so a malformed value stops the trainer there with one line."""
    text = os.environ.get(ENV)
    return parse(text) if text else None


def kills_at(phase: str, step: int, rank: int) -> bool:
    fault = active()
    return (
        fault is not None
        and fault.action == "kill"
        and fault.phase == phase
        and fault.step in (None, step)
        and fault.rank in (None, rank)
    )


def point(phase: str, step: int, rank: int) -> None:
    """A save of `step` on `rank` has reached `phase`: die here if the injected fault says so."""
    if active() is not None and kills_at(phase, step, rank):
        print(
            f"fault injection: kill -9 at {phase} of step {step} on rank {rank}", file=sys.stderr, flush=True
        )
        os.kill(os.getpid(), signal.SIGKILL)


def sigterm_no_time() -> bool:
    fault = active()
    return fault is not None and fault.action == "sigterm-no-time"


def sigterm_at_start() -> bool:
    fault = active()
    return fault is not None and fault.action == "sigterm-at-start"


def nan_gradients_at(step: int) -> bool:
    fault = active()
    return fault is not None and fault.action == "nan-gradients" and fault.step == step


def oom_at(step: int) -> bool:
    fault = active()
    return fault is not None and fault.action == "oom" and fault.step == step


def raise_at(step: int) -> None:
    """Optimizer step `step` is about to run its forward: raise the injected error here if the fault says
    so (test-only; trainstack.protocol.failures classifies what escapes the trainer)."""
    fault = active()
    if fault is not None and fault.action == "raise" and fault.step == step:
        raise RAISABLE[fault.phase](f"fault injection: {fault.phase} at step {step}")
