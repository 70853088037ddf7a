"""Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Two interchangeable backends build blocks with the same parameter names, shapes and math:

- Transformer Engine, on CUDA when it imports: `te.LayerNormLinear` (RMSNorm fused with the Q/K/V
  projection), TE's fused RoPE, `te.DotProductAttention` (cuDNN/flash, grouped-query heads native),
  `te.Linear` for the output projection and `te.LayerNormMLP` (RMSNorm, fc1, SwiGLU, fc2 in one
  module). Under FP8 each block input is quantized once per fused module, not once per GEMM.
- Pure PyTorch elsewhere (CPU tests, a GPU without TE, op-level selective checkpointing): modules
  that mirror TE's parameter layout exactly (`layer_norm_weight`, `weight`, `fc1_weight`,
  `fc2_weight`), attention through `scaled_dot_product_attention` with cuDNN first, then flash, and
  GQA native (`enable_gqa`: no repeated K/V copies).

So a block's state-dict keys are the same on both backends (TE adds only its `_extra_state` FP8
metadata). The output head is always a plain `nn.Linear` so FP8 never touches the logits, and the
loss is computed in chunks by `trainer.models.loss` so full FP32 logits never exist.

What a Hugging Face Llama / Qwen2 / Mistral config can say and this model follows (trainstack's
ModelShape): the RMSNorm epsilon (`norm_eps`), Q/K/V biases (`attention_bias`: Qwen2; TE's
`LayerNormLinear(bias=True)`, a `bias` parameter beside `weight`), a head width other than hidden /
heads (`head_dim`), and Llama 3.1's RoPE frequency scaling (`rope_scaling`, in `rope_inverse_frequencies`).
trainer.hf.conversion maps these parameters to and from a Hugging Face folder.

Rotary tables are FP32 buffers of the root module, passed to every block as a tuple. FSDP2 is told
not to cast forward inputs (trainer.distributed.parallel), so they reach attention in FP32: in BF16 the lowest
frequency of an 8K table has only 877 distinct (cos, sin) pairs.

Models are built on the meta device and materialised after sharding (`init_weights`), so a 64B model
never has to fit unsharded in one process.

**Packed rows** (fine-tuning, `training.objective: sft`; trainer.data.packing): `forward(tokens, labels,
packed=Packed(...))` takes rows holding several examples. Each row's rotary positions are its
`position_ids` (restarting at 0 per example) and attention never crosses an example: on the pure-PyTorch
backend SDPA gets the block-diagonal causal mask (`block_causal_mask`, built once per forward; SDPA's
flash kernel takes no mask, so cuDNN, memory-efficient or math runs); on Transformer Engine the batch is
flattened to TE's `thd` layout and both the fused RoPE and `DotProductAttention` (`padding_causal`) take
the varlen `cu_seqlens`, whose segments restart positions exactly where `position_ids` do (the padding
run is a segment of its own). The TE path cannot run on CPU: it is written from TE's documented API
(`apply_rotary_pos_emb(tensor_format="thd", cu_seqlens=...)`, `DotProductAttention.forward(...,
qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv, attn_mask_type)`) and checked on a GPU only. With
`packed`, forward returns the SUM of the target tokens' cross-entropy (labels -100 skipped): the trainer
divides by the global batch's target count (docs/trainer.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.models.loss import chunked_cross_entropy, chunked_cross_entropy_sum
from trainstack.recipes.schema import ModelShape, RopeScaling

log = logging.getLogger("trainer.model")  # its log lines' name before the package move
NORM_EPS = 1e-5  # ModelShape.norm_eps's default (Llama 3)
INIT_STD = 0.02
# SDPA backend priority, as torchtitan orders it: cuDNN attention where the GPU and torch support it,
# flash next, math (which repeats K/V for GQA and keeps the score matrix) only as the last resort.
# On CPU the flash backend is the CPU flash kernel. bench/trainer_gpu.py times cuDNN against flash.
SDPA_PRIORITY = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)
# With an explicit mask (packed rows) the flash kernel is not eligible; the memory-efficient one is.
MASKED_SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# --- pure-PyTorch modules, parameter-compatible with Transformer Engine's -------------------------
class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that saves exactly its input and the FP32 reciprocal RMS for backward, on every device.

    torch's own `rms_norm` is fused on CUDA but composite on CPU (there it saves three FP32 copies of
    the input), so what a block keeps for backward would differ between the CPU test that counts it
    and the GPU. This saves the same tensors everywhere; on CUDA in eager mode it calls the fused
    kernels; under torch.compile the math below is traced and fused by Inductor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.is_cuda and hasattr(torch.ops.aten, "_fused_rms_norm") and not torch.compiler.is_compiling():
            y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        else:
            xf = x.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = (xf * rstd * weight.float()).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        fused = hasattr(torch.ops.aten, "_fused_rms_norm_backward") and not torch.compiler.is_compiling()
        if x.is_cuda and fused:
            dx, dw = torch.ops.aten._fused_rms_norm_backward(
                grad.contiguous(), x, [x.shape[-1]], rstd, weight, [True, True]
            )
            return dx, dw, None
        xhat = x.float() * rstd
        dxhat = grad.float() * weight.float()
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        dw = (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """Like `te.RMSNorm` / `nn.RMSNorm`: one parameter, `weight`."""

    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class NormLinear(nn.Module):
    """RMSNorm then a linear, with `te.LayerNormLinear(normalization="RMSNorm", bias=...)`'s
    parameters: `layer_norm_weight` (in), `weight` (out, in) and, with `bias`, `bias` (out)."""

    def __init__(self, fan_in: int, fan_out: int, eps: float = NORM_EPS, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(fan_in))
        self.weight = nn.Parameter(torch.empty(fan_out, fan_in))
        self.bias = nn.Parameter(torch.zeros(fan_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.layer_norm_weight, self.eps), self.weight, self.bias)


class NormSwiGLU(nn.Module):
    """RMSNorm, fc1, SwiGLU, fc2, with `te.LayerNormMLP(normalization="RMSNorm", activation="swiglu",
    bias=False)`'s parameters: `layer_norm_weight` (h), `fc1_weight` (2 ffn, h), `fc2_weight` (h, ffn).
    fc1's output is [gate, up]: TE applies SiLU to the first half (TE docs, ops.SwiGLU)."""

    def __init__(self, hidden: int, ffn: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rms_norm(x, self.layer_norm_weight, self.eps), self.fc1_weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2_weight)


def rotary_tables(
    head_dim: int,
    seq_len: int,
    theta: float,
    device: torch.device,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 (cos, sin) of each position's angles, (seq, head_dim/2) each."""
    angles = rotary_angles(head_dim, seq_len, theta, device, scaling)
    return angles.cos(), angles.sin()


def rope_inverse_frequencies(
    head_dim: int, theta: float, device: torch.device, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """FP32 inverse frequencies theta^(-2i/d), i < d/2; with Llama 3.1's scaling (`rope_type:
    llama3`, the Llama 3.1 paper's long-context recipe, as Hugging Face's `rope_scaling` describes
    it): wavelengths longer than original_max_position_embeddings / low_freq_factor are stretched by
    `factor`, those shorter than original / high_freq_factor are kept, and the band between blends
    the two linearly in original / wavelength."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    original = float(scaling.original_max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > original / scaling.low_freq_factor
    stretched = torch.where(long_waves, inv_freq / scaling.factor, inv_freq)
    blend = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * stretched / scaling.factor + blend * stretched
    in_band = (wavelength >= original / scaling.high_freq_factor) & (
        wavelength <= original / scaling.low_freq_factor
    )
    return torch.where(in_band, blended, stretched)


def rotary_angles(
    head_dim: int, seq_len: int, theta: float, device: torch.device, scaling: RopeScaling | None = None
) -> torch.Tensor:
    inv_freq = rope_inverse_frequencies(head_dim, theta, device, scaling)
    return torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head, in FP32; x is (batch, seq, heads, dim).
    The same non-interleaved convention as TE's `apply_rotary_pos_emb(interleaved=False)`. cos and sin
    are (seq, dim/2), one position per token of every row, or (batch, seq, dim/2), each row's own
    positions (packed rows)."""
    first, second = x.float().chunk(2, dim=-1)
    if cos.dim() == 3:  # per row: (batch, seq, 1, dim/2)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]  # (seq, 1, dim/2)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.type_as(x)


class SDPAttention(nn.Module):
    """Causal attention through `scaled_dot_product_attention` in backend priority order. Inputs are
    (batch, seq, heads, dim); the kernels get (batch, heads, seq, dim) views and write their output
    in the query's memory layout, so the output projection reads it without a copy."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.gqa = heads != kv_heads
        self.sdpa_backends = list(SDPA_PRIORITY)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, seq = q.shape[:2]
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=self.gqa
            )
        return out.transpose(1, 2).reshape(batch, seq, -1)

    def forward_masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention under an explicit boolean mask (batch, 1, seq, seq), True where allowed: packed
        rows' block-diagonal causal mask. The flash kernel takes no mask, so cuDNN, memory-efficient
        and math are tried in that order."""
        batch, seq = q.shape[:2]
        with sdpa_kernel(MASKED_SDPA_PRIORITY, set_priority=True):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=self.gqa
            )
        return out.transpose(1, 2).reshape(batch, seq, -1)


class PackedRows(Protocol):
    """What `forward(..., packed=)` reads of a packed micro-batch (trainer.data.loader.PackedLayout,
    or `Packed` itself): the model does not import the data package (tests/test_architecture.py)."""

    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


@dataclass(frozen=True)
class Packed:
    """What a batch of packed rows (trainer.data.packing.collate) tells the model besides its tokens:
    each token's position within its example, which example it belongs to, and the same boundaries as
    the varlen kernels' cumulative lengths over the batch flattened row after row. The blocks receive
    it with the mask filled in where the backend needs one."""

    position_ids: torch.Tensor  # (batch, seq) int64, restarting at 0 per example
    segment_ids: torch.Tensor  # (batch, seq) int64
    cu_seqlens: torch.Tensor  # (segments + 1,) int32
    max_seqlen: int
    mask: torch.Tensor | None = None  # the block-causal mask, built once per forward where SDPA needs it


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query i may attend to key j: the same segment, j <= i."""
    seq = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril()
    return (same & causal)[:, None]


# --- backends -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """Factory for the pieces that differ between Transformer Engine and pure PyTorch."""

    name: str  # "transformer_engine" | "pytorch"
    # (fan_in, fan_out, eps, bias) -> RMSNorm + linear (the Q/K/V projection; bias for Qwen2)
    norm_linear: Callable[[int, int, float, bool], nn.Module]
    linear: Callable[[int, int], nn.Module]  # bias-free linear (attention output projection)
    norm_mlp: Callable[[int, int, float], nn.Module]  # (hidden, ffn, eps) -> RMSNorm + SwiGLU MLP
    norm: Callable[[int, float], nn.Module]  # (dim, eps) -> the final RMSNorm
    core_attention: Callable[[ModelShape], nn.Module]
    # (q, k, freqs...) -> (q, k) rotated; q and k are (batch, seq, heads, dim)
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (shape, seq_len, device) -> {buffer name: FP32 table}
    rope_tables: Callable[[ModelShape, int, torch.device], dict[str, torch.Tensor]]
    # Packed rows: (q, k, packed, tables...) -> (q, k) rotated at each row's position_ids, and
    # (core, q, k, v, packed) -> (batch, seq, heads x dim) attention that never crosses an example.
    packed_rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    packed_attention: Callable[..., torch.Tensor] | None = None
    needs_mask: bool = False  # packed attention reads Packed.mask (built by the model per forward)


def _pytorch_rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _pytorch_rope_tables(shape: ModelShape, seq_len: int, device: torch.device) -> dict:
    cos, sin = rotary_tables(shape.head_dim, seq_len, shape.rope_theta, device, shape.rope_scaling)
    return {"rope_cos": cos, "rope_sin": sin}


def _pytorch_packed_rotate(
    q: torch.Tensor, k: torch.Tensor, packed: Packed, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # The tables read at each token's own position: (batch, seq, dim/2).
    cos, sin = cos[packed.position_ids], sin[packed.position_ids]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _pytorch_packed_attention(
    core: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed
) -> torch.Tensor:
    return core.forward_masked(q, k, v, packed.mask)


def pytorch_backend() -> Backend:
    return Backend(
        "pytorch",
        norm_linear=NormLinear,
        linear=lambda fan_in, fan_out: nn.Linear(fan_in, fan_out, bias=False),
        norm_mlp=NormSwiGLU,
        norm=RMSNorm,
        core_attention=lambda shape: SDPAttention(shape.heads, shape.kv_heads),
        rotate=_pytorch_rotate,
        rope_tables=_pytorch_rope_tables,
        packed_rotate=_pytorch_packed_rotate,
        packed_attention=_pytorch_packed_attention,
        needs_mask=True,
    )


def transformer_engine_backend() -> Backend | None:
    """The TE backend, or None when transformer_engine.pytorch does not import."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
    except Exception as exc:  # ImportError, or a CUDA/ABI mismatch surfacing at import
        log.info("transformer_engine unavailable (%s: %s)", type(exc).__name__, exc)
        return None
    return _te_backend(te, apply_rotary_pos_emb)


def _te_backend(te, apply_rotary_pos_emb) -> Backend:
    """Built from TE's documented API (TE 2.8+; not run on CPU). device="meta": TE defers allocation
    like torch does under `torch.device("meta")`; the trainer initialises the values after sharding."""

    def rotate(q, k, freqs):
        # TE's fused RoPE kernel reads the FP32 angle table (seq, 1, 1, dim) and rotates halves.
        return (
            apply_rotary_pos_emb(q, freqs, tensor_format="bshd", fused=True),
            apply_rotary_pos_emb(k, freqs, tensor_format="bshd", fused=True),
        )

    def rope_tables(shape, seq_len, device):
        angles = rotary_angles(shape.head_dim, seq_len, shape.rope_theta, device, shape.rope_scaling)
        return {"rope_freqs": torch.cat((angles, angles), dim=-1)[:, None, None, :].contiguous()}

    # Packed rows in TE's `thd` layout (tokens of the batch flattened): the fused RoPE restarts the
    # positions at every cu_seqlens boundary (= the rows' position_ids), and the fused attention's
    # `padding_causal` keeps each segment to itself, with no score computed across segments.
    def packed_rotate(q, k, packed, freqs):
        batch, seq = q.shape[:2]

        def thd(x):
            out = apply_rotary_pos_emb(
                x.reshape(batch * seq, *x.shape[2:]),
                freqs,
                tensor_format="thd",
                fused=True,
                cu_seqlens=packed.cu_seqlens,
            )
            return out.view(batch, seq, *x.shape[2:])

        return thd(q), thd(k)

    def packed_attention(core, q, k, v, packed):
        batch, seq = q.shape[:2]
        flat = [x.reshape(batch * seq, *x.shape[2:]) for x in (q, k, v)]
        out = core(
            *flat,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            cu_seqlens_q=packed.cu_seqlens,
            cu_seqlens_kv=packed.cu_seqlens,
            max_seqlen_q=packed.max_seqlen,
            max_seqlen_kv=packed.max_seqlen,
        )
        return out.view(batch, seq, -1)

    return Backend(
        "transformer_engine",
        # bias=True gives LayerNormLinear a `bias` parameter (out,) added after the GEMM (TE docs,
        # LayerNormLinear): Qwen2's Q/K/V biases, the same name as the pure-PyTorch NormLinear's.
        norm_linear=lambda fan_in, fan_out, eps, bias: te.LayerNormLinear(
            fan_in, fan_out, eps=eps, bias=bias, normalization="RMSNorm", device="meta"
        ),
        linear=lambda fan_in, fan_out: te.Linear(fan_in, fan_out, bias=False, device="meta"),
        norm_mlp=lambda hidden, ffn, eps: te.LayerNormMLP(
            hidden, ffn, eps=eps, bias=False, normalization="RMSNorm", activation="swiglu", device="meta"
        ),
        norm=lambda dim, eps: te.RMSNorm(dim, eps=eps, device="meta"),
        core_attention=lambda shape: te.DotProductAttention(
            shape.heads,
            shape.head_dim,
            num_gqa_groups=shape.kv_heads,
            attention_dropout=0.0,
            qkv_format="bshd",
            attn_mask_type="causal",
        ),
        rotate=rotate,
        rope_tables=rope_tables,
        packed_rotate=packed_rotate,
        packed_attention=packed_attention,
    )


def select_backend(device_type: str, needs_pytorch_ops: bool = False) -> Backend:
    """TE on CUDA when it imports; pure PyTorch otherwise, or when the run needs every op visible to
    PyTorch's dispatcher (op-level selective checkpointing: TE's fused kernels bypass it, so a
    per-op policy could not save any of their outputs). The choice is logged by the caller."""
    if device_type == "cuda" and not needs_pytorch_ops:
        te_backend = transformer_engine_backend()
        if te_backend is not None:
            return te_backend
    return pytorch_backend()


# --- the model ------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, shape: ModelShape, backend: Backend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        qkv_width = shape.q_dim + 2 * shape.kv_dim
        self.qkv = backend.norm_linear(shape.hidden, qkv_width, shape.norm_eps, shape.attention_bias)
        self.core = backend.core_attention(shape)
        self.proj = backend.linear(shape.q_dim, shape.hidden)
        self._rotate = backend.rotate
        self._packed_rotate, self._packed_attention = backend.packed_rotate, backend.packed_attention

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], packed: Packed | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        if packed is not None:
            q, k = self._packed_rotate(q, k, packed, *rope)
            return self.proj(self._packed_attention(self.core, q, k, v.contiguous(), packed))
        q, k = self._rotate(q, k, *rope)
        # A copy of v (kv_heads wide) lets the fused Q/K/V output be freed after RoPE; as a view, v
        # would keep the whole (heads + 2 kv_heads) output alive until backward.
        return self.proj(self.core(q, k, v.contiguous()))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, backend: Backend):
        super().__init__()
        self.attention = Attention(shape, backend)
        self.feed_forward = backend.norm_mlp(shape.hidden, shape.ffn, shape.norm_eps)
        # Set by trainer.models.activation_checkpointing: recompute this block's activations in backward.
        # Kept as an attribute (not a wrapper module) so parameter names, and so checkpoints, do not
        # depend on the checkpointing mode.
        self.recompute: Callable[..., torch.Tensor] | None = None

    def _forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], packed: Packed | None = None
    ) -> torch.Tensor:
        x = x + self.attention(x, rope, packed)
        return x + self.feed_forward(x)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], packed: Packed | None = None
    ) -> torch.Tensor:
        # Packed rows pass one more argument; without them the call is the pretraining one, unchanged.
        args = (x, rope) if packed is None else (x, rope, packed)
        if self.recompute is not None:
            return self.recompute(self._forward, *args)
        return self._forward(*args)


# Parameters initialised to one (norm gains), to zero (the Q/K/V bias) and those scaled by
# 1/sqrt(2 * layers) (the projections that write into the residual stream), by name suffix; the same
# names on both backends.
ONES_SUFFIXES = ("layer_norm_weight", "norm.weight")
ZERO_SUFFIXES = ("qkv.bias",)
DEPTH_SCALED_SUFFIXES = ("proj.weight", "fc2_weight")


class Transformer(nn.Module):
    def __init__(self, shape: ModelShape, seq_len: int, backend: Backend, loss_chunk_tokens: int):
        super().__init__()
        self.shape, self.seq_len, self.backend_name = shape, seq_len, backend.name
        self.loss_chunk_tokens = loss_chunk_tokens
        self._rope_tables = backend.rope_tables
        self._needs_mask = backend.needs_mask
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(Block(shape, backend) for _ in range(shape.layers))
        self.norm = backend.norm(shape.hidden, shape.norm_eps)
        self.output = nn.Linear(shape.hidden, shape.vocab, bias=False)
        if shape.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        tables = self._rope_tables(shape, seq_len, torch.device("meta"))
        self.rope_names = tuple(tables)
        for name, table in tables.items():  # not persistent: recomputed, never checkpointed
            self.register_buffer(name, table, persistent=False)
        # Under context parallelism (trainer.distributed.context_parallel) the global positions of this rank's
        # tokens: the rotary tables are read at them. None: positions 0 .. seq - 1.
        self.rope_positions: torch.Tensor | None = None

    def rope(self) -> tuple[torch.Tensor, ...]:
        tables = tuple(getattr(self, name) for name in self.rope_names)
        if self.rope_positions is None:
            return tables
        return tuple(table.index_select(0, self.rope_positions) for table in tables)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Materialised values after `to_empty`: truncated normal for matrices (output projections
        scaled by 1/sqrt(2 * layers), GPT-2 style), ones for norm gains, zeros for biases, rotary
        tables recomputed. Call with the same torch seed on every rank."""
        depth_std = INIT_STD / math.sqrt(2 * self.shape.layers)
        for name, param in self.named_parameters():
            if name.endswith(ONES_SUFFIXES):
                param.fill_(1.0)
            elif name.endswith(ZERO_SUFFIXES):
                param.zero_()
            else:
                std = depth_std if name.endswith(DEPTH_SCALED_SUFFIXES) else INIT_STD
                _init_sharded(param, lambda t, std=std: nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std))
        self.init_rope()

    @torch.no_grad()
    def init_rope(self) -> None:
        """Recompute the rotary tables (not persistent: after `to_empty`, whatever loads the weights)."""
        device = getattr(self, self.rope_names[0]).device
        tables = self._rope_tables(self.shape, self.seq_len, device)
        for name, table in tables.items():
            getattr(self, name).copy_(table)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, packed: PackedRows | None = None
    ) -> torch.Tensor:
        """Mean next-token cross-entropy of `targets` given `tokens`, both (batch, seq); without
        `targets`, the full logits (batch, seq, vocab) (comparisons with a reference model: small
        inputs only, the logits are not chunked).

        With `packed` (rows of several examples, `targets` the rows' labels, -100 where nothing is
        learnt): the SUM of the target tokens' cross-entropy, not a mean, since the mean that training
        needs is over the target tokens of the whole global batch, which one forward cannot see."""
        if packed is not None and self.rope_positions is not None:
            raise ValueError("packed rows under context parallelism are not supported")
        x = self.tok_embeddings(tokens)
        rope = self.rope()
        if packed is None:
            for block in self.layers:
                x = block(x, rope)
            if targets is None:
                return self.output(self.norm(x))
            return chunked_cross_entropy(self.norm(x), targets, self.output, self.loss_chunk_tokens)
        packed = Packed(
            packed.position_ids,
            packed.segment_ids,
            packed.cu_seqlens,
            packed.max_seqlen,
            block_causal_mask(packed.segment_ids) if self._needs_mask else None,
        )
        for block in self.layers:
            x = block(x, rope, packed)
        if targets is None:
            return self.output(self.norm(x))
        return chunked_cross_entropy_sum(self.norm(x), targets, self.output, self.loss_chunk_tokens)


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


def compile_decision(requested: bool | None, device_type: str, backend_name: str) -> tuple[bool, str]:
    """(compile the blocks?, why) for `training.compile` (None: on for CUDA, as the recipe says)."""
    if requested is False:
        return False, "off (training.compile: false)"
    if requested:
        return True, "on (training.compile: true)"
    if device_type != "cuda":
        return False, "off (default off the GPU)"
    if backend_name == "transformer_engine":
        # TE's fused modules are already the kernels, and dynamo cannot trace into them (graph breaks
        # at every module); training.compile: true compiles the code between them anyway.
        return False, "off (default with Transformer Engine's fused modules)"
    return True, "on (default on CUDA)"


def compile_blocks(model: Transformer, backend: str = "inductor") -> None:
    """torch.compile each block's `forward` in place (parameter names unchanged), one graph for
    every block alike, reused by all (torchtitan's per-block compile; blocks that recompute and blocks
    that do not are two graphs). fullgraph: a graph break is an error, not a silent slowdown.

    `forward`, not the module's `__call__` (what `Module.compile` compiles): `__call__` runs the
    block's hooks, and dynamo would trace them too. FSDP2's hooks opt out of tracing
    (`torch._dynamo.disable`), but the trainer's block timer (trainer.metrics.throughput) reads the
    host clock or records CUDA events, which dynamo cannot trace ("Attempted to call function marked
    as skipped: time.perf_counter" under fullgraph), and its `armed` flag, traced, would be a guard
    that recompiles the blocks on every log step. So hooks stay eager at the block's edges and only
    the computation between them is compiled: the activation checkpoint (dynamo's checkpoint
    higher-order op, so the op-level policy still decides what is saved), attention, and under context
    parallelism the K/V all-gather (trainer.distributed.context_parallel: dynamo rewrites its c10d
    collectives into functional ones and traces them into the graph). A Transformer Engine block
    graph-breaks at each fused module, so it is compiled without fullgraph: `training.compile: true`
    with TE compiles the code between them."""
    fullgraph = model.backend_name == "pytorch"
    for block in model.layers:
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)


def build_model(shape: ModelShape, seq_len: int, backend: Backend, loss_chunk_tokens: int) -> Transformer:
    """The model on the meta device: no memory is allocated until `to_empty` after sharding."""
    with torch.device("meta"):
        return Transformer(shape, seq_len, backend, loss_chunk_tokens)
