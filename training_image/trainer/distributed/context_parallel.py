"""Context parallelism: one sequence split over `cp` ranks, attention computed across the split.

Layout (the Llama 3 paper's all-gather context parallelism, Dubey et al. 2024, section 3.3.2; the
same layout Transformer Engine's context parallelism expects): the sequence of S tokens is cut into
2 x cp chunks of S / (2 cp) tokens, and CP rank i holds chunks i and 2cp-1-i, concatenated. Under a
causal mask a chunk's attention work grows with its index, so pairing an early chunk with a late one
gives every rank the same work. Everything per token (embedding, RMSNorm, projections, MLP, the loss)
runs on the local 2 chunks only; RoPE uses each local token's global position (`positions`), and
attention is the one op that needs other ranks' tokens:

- Transformer Engine (GPU): `DotProductAttention.set_context_parallel_group(cp_group,
  cp_global_ranks, cp_stream, cp_comm_type)`; TE exchanges K/V itself (`p2p`: a ring of K/V blocks
  overlapped with each block's attention, the default here; `all_gather`; `a2a`: Ulysses-style head
  scatter) and takes inputs in exactly the layout above. Coded against TE's documented API (TE 2.x,
  transformer_engine.pytorch.DotProductAttention); it cannot run on the CPU machines the tests use.
- Pure PyTorch (CPU tests, a GPU without TE, op-level checkpointing): K and V are all-gathered over
  the CP group (`gather_sequence`: its backward reduce-scatters the gradients of K and V,
  so each rank gets the sum of every rank's gradient for its own tokens), left in gather order (the
  mask follows it), and attended with a causal mask over global positions: query at
  position p sees key at position t iff t <= p. The mask is additive, in the compute dtype, built once
  per (dtype, device) and shared by every block, so SDPA keeps one copy, not one per layer.

Data and gradients: the CP ranks of one data-parallel rank read the same samples and each keeps its
chunks (`split`); every rank's loss is the mean over its local tokens. All ranks hold the same number
of tokens (S / cp per sample: the schema requires seq_len divisible by 2 cp), so the mean of the CP
ranks' means is the sequence's mean, and FSDP's gradient average over the combined (data-parallel
shard x cp) ranks, which the CP ranks share weights in (torchtitan shards over `dp_shard_cp` the same
way), is the gradient of the mean loss over the global batch; the reported loss, all-reduced over
every rank and divided by the world size (trainer.train), is likewise the mean over every token. The
device mesh is (replicate, shard, cp), rank = (r x shard + s) x cp + c; FSDP shards over the
flattened (shard, cp) dimension and replicates across `replicate` (HSDP), so gradients are
reduce-scattered within the shard x cp ranks and all-reduced across nodes.

Checkpoints do not depend on cp: parameters and optimizer states are DTensors that DCP reshards on
load, and the data position counts samples, which every CP rank of a group shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.attention import sdpa_kernel

from trainer.distributed.parallel import build_mesh

# TE's cp_comm_type for the GPU path. p2p (ring) overlaps each K/V block's transfer with the previous
# block's attention (Megatron-Core's default, `--cp-comm-type p2p`); all_gather exposes one gather
# per layer (the Llama 3 paper's choice, cheap with GQA); a2a needs heads divisible by cp.
TE_CP_COMM_TYPE = "p2p"


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of CP rank `rank`'s tokens: chunk `rank`, then chunk 2cp-1-rank (int64)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} is not divisible by 2 x cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat(
        (torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk))
    )


@dataclass
class ContextParallel:
    """This rank's place in its CP group; size 1 (group None) is no context parallelism."""

    size: int
    rank: int
    seq_len: int
    group: dist.ProcessGroup | None = None
    global_ranks: tuple[int, ...] = ()
    positions: torch.Tensor = field(init=False)
    _masks: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.positions = chunk_positions(self.seq_len, self.size, self.rank)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def split(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of (batch, seq_len) tokens or targets: (batch, seq_len / cp)."""
        if not self.enabled:
            return tokens
        return tokens.index_select(1, self.positions.to(tokens.device))

    def gathered_positions(self) -> torch.Tensor:
        """Global positions of the all-gathered keys, in gather order (CP rank 0's, then 1's, ...)."""
        return torch.cat([chunk_positions(self.seq_len, self.size, r) for r in range(self.size)])

    def causal_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive (local_len, seq_len) mask: 0 where the local query may see the gathered key, -inf
        elsewhere. One per (dtype, device), shared by every block."""
        key = (dtype, device)
        mask = self._masks.get(key)
        if mask is None:
            allowed = self.positions[:, None] >= self.gathered_positions()[None, :]
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)
            # Under torch.compile this runs inside the block's activation checkpoint, where dynamo
            # refuses a mutation of state outside it ("HOP: Unsafe side effect"): the block's eager
            # pre-forward hook (`apply_context_parallel`) fills the cache first, so compiled blocks only
            # read it; a miss there still gets a correct mask, just not the shared one.
            if not torch.compiler.is_compiling():
                self._masks[key] = mask
        return mask


class _GatherSequence(torch.autograd.Function):
    """All-gather along the first dimension in forward; reduce-scatter (sum) of the gradient in
    backward. Plain c10d collectives (NCCL and gloo both have all_gather_into_tensor and
    reduce_scatter_tensor), so what a block saves stays countable by a dispatch mode on CPU. Under
    torch.compile dynamo traces forward and backward, rewriting both collectives into its functional
    ones (`_c10d_functional.all_gather_into_tensor` / `reduce_scatter_tensor` + `wait_tensor`): the
    block stays one graph."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        gathered = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        local = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(local, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return local, None, None


def gather_sequence(local: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """All-gather (batch, local_len, heads, dim) over the CP group along the sequence, in rank order:
    a (batch, seq_len, heads, dim) view of one sequence-major buffer. Differentiable: backward
    reduce-scatters (sums) the gradient, so each rank receives every rank's gradient for its own K/V."""
    sequence_major = local.transpose(0, 1).contiguous()  # (local_len, batch, heads, dim)
    return _GatherSequence.apply(sequence_major, cp.group, cp.size).transpose(0, 1)


class ContextParallelSDPAttention(nn.Module):
    """Pure-PyTorch attention across CP ranks (see the module doc): all-gather K/V, masked SDPA."""

    def __init__(self, inner: nn.Module, cp: ContextParallel):
        super().__init__()
        self.gqa, self.sdpa_backends = inner.gqa, inner.sdpa_backends
        self.cp = cp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, seq = q.shape[:2]
        k_all, v_all = gather_sequence(k, self.cp), gather_sequence(v, self.cp)
        mask = self.cp.causal_mask(q.dtype, q.device)
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k_all.transpose(1, 2),
                v_all.transpose(1, 2),
                attn_mask=mask,
                enable_gqa=self.gqa,
            )
        return out.transpose(1, 2).reshape(batch, seq, -1)


def _set_te_context_parallel(core: nn.Module, cp: ContextParallel, stream: torch.cuda.Stream) -> None:
    """TE's documented API (DotProductAttention.set_context_parallel_group(cp_group, cp_global_ranks,
    cp_stream, cp_comm_type)); TE then expects bshd inputs in the 2 x cp load-balanced layout."""
    core.set_context_parallel_group(cp.group, list(cp.global_ranks), stream, cp_comm_type=TE_CP_COMM_TYPE)


def apply_context_parallel(model: nn.Module, cp: ContextParallel, device: torch.device) -> None:
    """Make every block's attention span the CP group and RoPE read global positions (a no-op at cp
    1). Before compiling and sharding, on the meta-device model; `device` is where it will run."""
    if not cp.enabled:
        return
    model.rope_positions = cp.positions.to(device)
    if model.backend_name == "transformer_engine":
        stream = torch.cuda.Stream()  # TE overlaps the K/V exchange with attention on this stream
        for block in model.layers:
            _set_te_context_parallel(block.attention.core, cp, stream)
        return
    for block in model.layers:
        block.attention.core = ContextParallelSDPAttention(block.attention.core, cp)
        block.register_forward_pre_hook(partial(_fill_mask_cache, cp))


def _fill_mask_cache(cp: ContextParallel, block: nn.Module, args: tuple) -> None:
    """Pre-forward hook of every CP block: make the causal mask for the block input's dtype and device
    before the block runs. Hooks run eagerly (trainer.models.model.compile_blocks compiles `forward`
    only), so a compiled block finds the one shared mask (see `ContextParallel.causal_mask`)."""
    x = args[0]
    cp.causal_mask(x.dtype, x.device)


# --- the device mesh -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Meshes:
    """FSDP's mesh (1-D shard x cp, or 2-D replicate x (shard x cp)) and this rank's CP group."""

    fsdp: DeviceMesh
    cp: ContextParallel
    data_rank: int  # this rank among the ranks that read different samples
    data_ranks: int


def build_meshes(device_type: str, world: int, shard: int, cp: int, seq_len: int) -> Meshes:
    """The (replicate, shard, cp) mesh as torchtitan builds its (dp_replicate, dp_shard, cp) one; at cp
    1 the trainer's usual (shard) or (replicate, shard) mesh."""
    rank = dist.get_rank()
    if cp == 1:
        return Meshes(build_mesh(device_type, world, shard), ContextParallel(1, 0, seq_len), rank, world)
    replicate = world // (shard * cp)
    mesh = init_device_mesh(device_type, (replicate, shard, cp), mesh_dim_names=("replicate", "shard", "cp"))
    mesh["shard", "cp"]._flatten("shard_cp")
    fsdp = mesh["shard_cp"] if replicate == 1 else mesh["replicate", "shard_cp"]
    cp_mesh = mesh["cp"]
    group = cp_mesh.get_group()
    context = ContextParallel(
        cp, cp_mesh.get_local_rank(), seq_len, group, tuple(dist.get_process_group_ranks(group))
    )
    return Meshes(fsdp, context, rank // cp, world // cp)
