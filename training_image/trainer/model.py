"""Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Two interchangeable backends build the same modules with the same parameter names, shapes and math:
Transformer Engine (`te.Linear`, `te.RMSNorm`; their GEMMs run in FP8 inside TE's autocast) when it
imports, pure PyTorch otherwise (CPU tests, GPUs without TE). The output head is always a plain
`nn.Linear` so FP8 autocast never touches the logits, and the loss is computed in chunks by
`trainer.loss` so full FP32 logits never exist.

Models are built on the meta device and materialised after sharding (`init_weights`), so a 64B model
never has to fit unsharded in one process.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.loss import chunked_cross_entropy
from trainstack.recipe import ModelShape

log = logging.getLogger(__name__)
NORM_EPS = 1e-5
INIT_STD = 0.02


@dataclass(frozen=True)
class Backend:
    """Factory for the layers that differ between Transformer Engine and pure PyTorch."""

    name: str  # "transformer_engine" | "pytorch"
    linear: Callable[[int, int], nn.Module]
    norm: Callable[[int], nn.Module]


def pytorch_backend() -> Backend:
    return Backend(
        "pytorch",
        linear=lambda fan_in, fan_out: nn.Linear(fan_in, fan_out, bias=False),
        norm=lambda dim: nn.RMSNorm(dim, eps=NORM_EPS),
    )


def transformer_engine_backend() -> Backend | None:
    """The TE backend, or None when transformer_engine.pytorch does not import."""
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # ImportError, or a CUDA/ABI mismatch surfacing at import
        log.info("transformer_engine unavailable (%s: %s)", type(exc).__name__, exc)
        return None
    # device="meta": TE defers allocation like torch does under `torch.device("meta")`.
    return Backend(
        "transformer_engine",
        linear=lambda fan_in, fan_out: te.Linear(fan_in, fan_out, bias=False, device="meta"),
        norm=lambda dim: te.RMSNorm(dim, eps=NORM_EPS, device="meta"),
    )


def select_backend(device_type: str) -> Backend:
    """TE on CUDA when it imports; pure PyTorch otherwise. The choice is logged by the caller."""
    if device_type == "cuda":
        te_backend = transformer_engine_backend()
        if te_backend is not None:
            return te_backend
    return pytorch_backend()


def rotary_tables(
    head_dim: int, seq_len: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()  # (seq, head_dim/2) each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head; x is (batch, heads, seq, head_dim)."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, backend: Backend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.wq = backend.linear(shape.hidden, shape.heads * shape.head_dim)
        self.wk = backend.linear(shape.hidden, shape.kv_heads * shape.head_dim)
        self.wv = backend.linear(shape.hidden, shape.kv_heads * shape.head_dim)
        self.wo = backend.linear(shape.heads * shape.head_dim, shape.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, shape: ModelShape, backend: Backend):
        super().__init__()
        self.w1 = backend.linear(shape.hidden, shape.ffn)
        self.w3 = backend.linear(shape.hidden, shape.ffn)
        self.w2 = backend.linear(shape.ffn, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, backend: Backend):
        super().__init__()
        self.attention_norm = backend.norm(shape.hidden)
        self.attention = Attention(shape, backend)
        self.ffn_norm = backend.norm(shape.hidden)
        self.feed_forward = FeedForward(shape, backend)
        # Set by trainer.activation_checkpointing: recompute this block's activations in backward.
        # Kept as an attribute (not a wrapper module) so parameter names, and so checkpoints, do not
        # depend on the checkpointing mode.
        self.recompute: Callable[..., torch.Tensor] | None = None

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute is not None:
            return self.recompute(self._forward, x, cos, sin)
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    def __init__(self, shape: ModelShape, seq_len: int, backend: Backend, loss_chunk_tokens: int):
        super().__init__()
        self.shape, self.seq_len, self.backend_name = shape, seq_len, backend.name
        self.loss_chunk_tokens = loss_chunk_tokens
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(Block(shape, backend) for _ in range(shape.layers))
        self.norm = backend.norm(shape.hidden)
        self.output = nn.Linear(shape.hidden, shape.vocab, bias=False)
        if shape.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(shape.head_dim, seq_len, shape.rope_theta, torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Materialised values after `to_empty`: truncated normal for matrices (output projections
        scaled by 1/sqrt(2 * layers), GPT-2 style), ones for norms, rotary tables recomputed.
        Call with the same torch seed on every rank."""
        depth_std = INIT_STD / math.sqrt(2 * self.shape.layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = depth_std if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
                _init_sharded(param, lambda t, std=std: nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std))
        device = self.rope_cos.device
        cos, sin = rotary_tables(self.shape.head_dim, self.seq_len, self.shape.rope_theta, device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of `targets` given `tokens`, both (batch, seq)."""
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x, self.rope_cos, self.rope_sin)
        return chunked_cross_entropy(self.norm(x), targets, self.output, self.loss_chunk_tokens)


def _init_sharded(param: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
    """Initialise `param` in place so that its values do not depend on how it is sharded.

    On CUDA meshes DTensor's random ops already guarantee that (offset-based Philox). On CPU meshes
    they would draw every shard from the same local RNG stream (identical shards), so there the full
    tensor is drawn on every rank alike and each rank keeps its own shard (tests and small models only).
    """
    if isinstance(param, DTensor) and param.device_mesh.device_type == "cpu":
        full = torch.empty(param.shape, dtype=param.dtype)
        init(full)
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        init(param)


def build_model(shape: ModelShape, seq_len: int, backend: Backend, loss_chunk_tokens: int) -> Transformer:
    """The model on the meta device: no memory is allocated until `to_empty` after sharding."""
    with torch.device("meta"):
        return Transformer(shape, seq_len, backend, loss_chunk_tokens)
