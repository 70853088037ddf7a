"""Count what a module really keeps for backward: bytes of tensor storage alive between forward and
backward, deduplicated by storage, at their dtype sizes. Used by tests/trainer/test_trainer_memory.py
(on CPU, against trainstack.planner.trainer_memory) and by bench/trainer_gpu.py (the same count on a GPU).

Two counts, which must agree where both apply:

- `hooked`: tensors autograd packs through `torch.autograd.graph.saved_tensors_hooks`. It sees what
  ops save outside activation checkpointing, but not what a checkpoint keeps (the checkpoint's own
  hooks take over inside it, and selective checkpointing caches op outputs apart from autograd).
- `live`: every storage created during forward (recorded through a TorchDispatchMode, weakly) plus
  the input's, still alive once forward has returned and every other reference is dropped. That is
  what the memory holds, whatever keeps it: autograd, a checkpoint's inputs, a selective cache.

Parameters, buffers and extra tensors the caller names (the rotary tables), and the module's own
output (the next module's input, counted there) are left out.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class SavedBytes:
    live: int
    hooked: int
    tensors: int  # distinct live storages


class _StorageRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}  # data pointer -> (weak ref, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def count_saved_bytes(
    module: torch.nn.Module,
    make_input: Callable[[], torch.Tensor],
    extra_args: tuple = (),
    excluded: Iterable[torch.Tensor] = (),
) -> tuple[SavedBytes, torch.Tensor]:
    """Run `module(make_input(), *extra_args)` and count what stays alive for backward. Returns the
    count and the output (call backward on it, or drop it, to free what is held)."""
    skip = {_ptr(t) for t in (*module.parameters(), *module.buffers(), *excluded)}
    skip |= {_ptr(t) for t in tree_leaves(extra_args) if isinstance(t, torch.Tensor)}
    hooked: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if _ptr(tensor) not in skip:
            hooked[_ptr(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    recorder = _StorageRecorder()
    x = make_input()
    recorder.storages[_ptr(x)] = (StorageWeakRef(x.untyped_storage()), x.untyped_storage().nbytes())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), recorder:
        out = module(x, *extra_args)
    del x
    gc.collect()
    skip.add(_ptr(out))
    live = {
        ptr: nbytes
        for ptr, (ref, nbytes) in recorder.storages.items()
        if ptr and ptr not in skip and not ref.expired()
    }
    hooked_bytes = sum(n for ptr, n in hooked.items() if ptr not in skip)
    return SavedBytes(live=sum(live.values()), hooked=hooked_bytes, tensors=len(live)), out
