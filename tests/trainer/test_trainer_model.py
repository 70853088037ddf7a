"""The model's GPU-facing choices, pinned on CPU: FP32 RoPE through FSDP2, attention kernels and GQA,
the Transformer Engine backend's modules and names, backend selection, compile per block, op-level
selective checkpointing."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trainer.config import recipe_from_json
from trainer.data.loader import SyntheticTokens
from trainer.distributed.parallel import shard_model
from trainer.models import model as model_module
from trainer.models.activation_checkpointing import (
    ATTENTION_OPS,
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_op_level,
)
from trainer.models.model import (
    SDPA_PRIORITY,
    Block,
    NormSwiGLU,
    _te_backend,
    build_model,
    compile_blocks,
    compile_decision,
    pytorch_backend,
    rms_norm,
    rotary_tables,
    select_backend,
)
from trainer_helpers import TINY

from trainstack.errors import RecipeError
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import ActivationCheckpointing, ModelShape, Recipe, to_hyperparameters

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def tiny():
    return resolve(str(TINY)).recipe


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    dist.destroy_process_group()


def tokens(recipe, batch: int = 2) -> torch.Tensor:
    source = SyntheticTokens(recipe.model.vocab, recipe.training.seq_len, 1)
    return torch.from_numpy(np.stack([source.sample(i) for i in range(batch)]))


def materialised(recipe, ac: ActivationCheckpointing | None = None):
    torch.manual_seed(0)
    tr = recipe.training
    model = build_model(recipe.model, tr.seq_len, pytorch_backend(), tr.loss_chunk_tokens)
    if ac is not None:
        apply_activation_checkpointing(model, ac)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def gradients(model, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    model(batch[:, :-1], batch[:, 1:]).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


# --- RoPE in FP32 -----------------------------------------------------------------------------------
def test_rotary_tables_reach_attention_in_fp32_through_fsdp(tiny, world_of_one):
    """FSDP2's default MixedPrecisionPolicy casts every float argument of a unit to BF16, the FP32
    cos/sin tables included (at 8K positions the lowest frequency then keeps only 877 distinct
    (cos, sin) pairs). Whatever reaches attention besides x must be the exact FP32 tables."""
    torch.manual_seed(0)
    tr = tiny.training
    model = build_model(tiny.model, tr.seq_len, pytorch_backend(), tr.loss_chunk_tokens)
    shard_model(model, world_of_one)
    model.to_empty(device="cpu")
    model.init_weights()
    seen: list[torch.Tensor] = []
    for block in model.layers:
        block.attention.register_forward_pre_hook(
            lambda module, args: seen.extend(t for t in tree_leaves(args[1:]) if isinstance(t, torch.Tensor))
        )
    batch = tokens(tiny)
    model(batch[:, :-1], batch[:, 1:]).backward()
    assert seen and {t.dtype for t in seen} == {torch.float32}, {t.dtype for t in seen}
    cos, sin = rotary_tables(tiny.model.head_dim, tr.seq_len, tiny.model.rope_theta, torch.device("cpu"))
    assert any(torch.equal(t, cos) for t in seen) and any(torch.equal(t, sin) for t in seen)


# --- pure-PyTorch modules -------------------------------------------------------------------------
def test_rms_norm_equals_torch_in_value_and_gradient():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.rand(16, dtype=torch.float64, requires_grad=True)
    ours = rms_norm(x, w, 1e-5)
    reference = F.rms_norm(x, (16,), w, 1e-5)
    grad = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, (x, w), grad)
    reference_grads = torch.autograd.grad(reference, (x, w), grad)
    # The function computes in FP32 (as the fused kernels do), so agreement is to FP32 precision.
    assert torch.allclose(ours, reference, atol=1e-6)
    for a, b in zip(ours_grads, reference_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_swiglu_gates_the_first_half_of_fc1_as_transformer_engine_does():
    torch.manual_seed(0)
    mlp = NormSwiGLU(8, 6)
    for p in (mlp.fc1_weight, mlp.fc2_weight):
        nn.init.normal_(p)
    x = torch.randn(2, 3, 8)
    normed = F.rms_norm(x, (8,), mlp.layer_norm_weight, mlp.eps)
    gate, up = mlp.fc1_weight[:6], mlp.fc1_weight[6:]
    expected = (F.silu(normed @ gate.T) * (normed @ up.T)) @ mlp.fc2_weight.T
    assert torch.allclose(mlp(x), expected, atol=1e-5)


class _AttentionCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_OPS:
            self.calls.append((str(func), tuple(args[1].shape)))  # the key as the kernel gets it
        return func(*args, **(kwargs or {}))


def test_grouped_query_attention_runs_a_fused_kernel_on_the_kv_heads_as_they_are(tiny):
    assert list(SDPA_PRIORITY[:2]) == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    m = tiny.model
    block = materialised(tiny).layers[0]
    x = torch.randn(2, tiny.training.seq_len, m.hidden)
    cos, sin = rotary_tables(m.head_dim, tiny.training.seq_len, m.rope_theta, torch.device("cpu"))
    with _AttentionCalls() as recorded:
        out = block.attention(x, (cos, sin))
    # One fused kernel (the CPU flash kernel here), given the kv_heads K/V: no repeat_interleave copy.
    ((op, key_shape),) = recorded.calls
    assert "flash" in op and key_shape[1] == m.kv_heads, recorded.calls
    # And it computes what plain causal attention over repeated K/V heads computes.
    attention = block.attention
    qkv = attention.qkv(x).view(2, -1, m.heads + 2 * m.kv_heads, m.head_dim)
    q, k, v = qkv.split([m.heads, m.kv_heads, m.kv_heads], dim=2)
    q, k = model_module.apply_rotary(q, cos, sin), model_module.apply_rotary(k, cos, sin)
    groups = m.heads // m.kv_heads
    k, v = (t.transpose(1, 2).repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.transpose(1, 2) @ k.transpose(-1, -2)) / m.head_dim**0.5
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    reference = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2).flatten(2)
    assert torch.allclose(out, attention.proj(reference), atol=1e-5)


# --- Transformer Engine backend -------------------------------------------------------------------
def fake_transformer_engine(calls: list[tuple[str, dict]]):
    """Stand-ins with Transformer Engine's constructor signatures and parameter names (TE 2.8
    source: module/layernorm_linear.py, layernorm_mlp.py, linear.py, rmsnorm.py), recording how the
    backend constructs them. They check the wiring, not TE."""

    def recorder(name):
        def init(self, *args, **kwargs):
            nn.Module.__init__(self)
            calls.append((name, {"args": args, **kwargs}))
            device = kwargs.get("device", "cuda")
            if name == "LayerNormLinear":
                self.layer_norm_weight = nn.Parameter(torch.empty(args[0], device=device))
                self.weight = nn.Parameter(torch.empty(args[1], args[0], device=device))
                if kwargs.get("bias", True):  # TE's default is bias=True
                    self.bias = nn.Parameter(torch.empty(args[1], device=device))
            elif name == "Linear":
                self.weight = nn.Parameter(torch.empty(args[1], args[0], device=device))
            elif name == "LayerNormMLP":
                gated = 2 if kwargs["activation"] in ("swiglu", "geglu", "reglu") else 1
                self.layer_norm_weight = nn.Parameter(torch.empty(args[0], device=device))
                self.fc1_weight = nn.Parameter(torch.empty(gated * args[1], args[0], device=device))
                self.fc2_weight = nn.Parameter(torch.empty(args[0], args[1], device=device))
            elif name == "RMSNorm":
                self.weight = nn.Parameter(torch.empty(args[0], device=device))

        return type(name, (nn.Module,), {"__init__": init})

    names = ("LayerNormLinear", "Linear", "LayerNormMLP", "RMSNorm", "DotProductAttention")
    return types.SimpleNamespace(**{n: recorder(n) for n in names})


QWEN2_LIKE = {  # Q/K/V bias, eps 1e-6, a head width other than hidden / heads, Llama 3.1 RoPE scaling
    "attention_bias": True,
    "norm_eps": 1e-6,
    "head_dim": 32,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


@pytest.mark.parametrize("variant", ["llama", "qwen2-like"])
def test_transformer_engine_backend_uses_fused_modules_with_the_pure_blocks_parameter_names(tiny, variant):
    calls: list[tuple[str, dict]] = []
    te_backend = _te_backend(fake_transformer_engine(calls), apply_rotary_pos_emb=None)
    m = tiny.model if variant == "llama" else ModelShape(**{**tiny.model.model_dump(), **QWEN2_LIKE})
    with torch.device("meta"):
        te_block, pure_block = Block(m, te_backend), Block(m, pytorch_backend())
    shapes = lambda block: {n: tuple(p.shape) for n, p in block.named_parameters()}  # noqa: E731
    assert shapes(te_block) == shapes(pure_block)
    assert ("attention.qkv.bias" in shapes(te_block)) == m.attention_bias
    by_name = {name: kwargs for name, kwargs in calls}
    qkv = by_name["LayerNormLinear"]
    assert qkv["normalization"] == "RMSNorm" and qkv["bias"] == m.attention_bias and qkv["eps"] == m.norm_eps
    mlp = by_name["LayerNormMLP"]
    assert (mlp["normalization"], mlp["activation"], mlp["bias"], mlp["eps"]) == (
        "RMSNorm",
        "swiglu",
        False,
        m.norm_eps,
    )
    attention = by_name["DotProductAttention"]
    assert attention["args"] == (m.heads, m.head_dim) and attention["num_gqa_groups"] == m.kv_heads
    assert (attention["qkv_format"], attention["attn_mask_type"]) == ("bshd", "causal")
    # TE's fused RoPE reads one FP32 angle table laid out (seq, 1, 1, head_dim), scaled as the shape says.
    (freqs,) = te_backend.rope_tables(m, 32, torch.device("cpu")).values()
    assert freqs.dtype == torch.float32 and freqs.shape == (32, 1, 1, m.head_dim)
    cos, _ = rotary_tables(m.head_dim, 32, m.rope_theta, torch.device("cpu"), m.rope_scaling)
    assert torch.allclose(freqs[:, 0, 0, : m.head_dim // 2].cos(), cos)
    with torch.device("meta"):
        te_backend.norm(m.hidden, m.norm_eps)
    assert calls[-1][0] == "RMSNorm" and calls[-1][1]["eps"] == m.norm_eps


@pytest.mark.parametrize(
    "device_type, te_imports, needs_pytorch_ops, expected",
    [
        ("cpu", True, False, "pytorch"),
        ("cuda", True, False, "transformer_engine"),
        ("cuda", False, False, "pytorch"),
        ("cuda", True, True, "pytorch"),  # op-level checkpointing needs every op visible
    ],
)
def test_backend_selection(monkeypatch, device_type, te_imports, needs_pytorch_ops, expected):
    fake = types.SimpleNamespace(name="transformer_engine")
    monkeypatch.setattr(model_module, "transformer_engine_backend", lambda: fake if te_imports else None)
    assert select_backend(device_type, needs_pytorch_ops).name == expected


# --- compile --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "requested, device_type, backend, expected",
    [
        (None, "cuda", "pytorch", True),
        (None, "cpu", "pytorch", False),
        (None, "cuda", "transformer_engine", False),
        (True, "cpu", "pytorch", True),
        (True, "cuda", "transformer_engine", True),
        (False, "cuda", "pytorch", False),
    ],
)
def test_compile_follows_the_recipe_and_defaults_on_for_the_gpu(requested, device_type, backend, expected):
    assert compile_decision(requested, device_type, backend)[0] is expected


@pytest.mark.parametrize("mode", ["none", "op"])
def test_compiled_blocks_compute_what_eager_blocks_do(tiny, mode):
    """Each block compiled as one graph (fullgraph: a graph break fails here), with parameter names
    unchanged; aot_eager runs dynamo and AOTAutograd as inductor would, without a C++ build."""
    ac = ActivationCheckpointing(mode="selective", policy="op") if mode == "op" else None
    batch = tokens(tiny)
    eager = materialised(tiny, ac)
    compiled = materialised(tiny, ac)
    compile_blocks(compiled, backend="aot_eager")
    assert list(compiled.state_dict()) == list(eager.state_dict())
    expected, got = gradients(eager, batch), gradients(compiled, batch)
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name


# --- op-level selective checkpointing ---------------------------------------------------------------
def test_op_level_checkpointing_changes_memory_not_math(tiny):
    batch = tokens(tiny)
    plain = gradients(materialised(tiny), batch)
    op_level = gradients(materialised(tiny, ActivationCheckpointing(mode="selective", policy="op")), batch)
    for name in plain:
        assert torch.allclose(op_level[name], plain[name], atol=1e-6), name


@pytest.mark.parametrize(
    "precision, checkpointing, backend, blocks",
    [
        ({"dtype": "bf16"}, {"mode": "selective", "policy": "op"}, "pytorch", [0, 1]),
        ({"dtype": "bf16"}, {"mode": "full"}, "transformer_engine", [0, 1]),
        ({"dtype": "bf16"}, {"mode": "none"}, "transformer_engine", []),
        ({"dtype": "fp8", "fp8_recipe": "current"}, {"mode": "full"}, "transformer_engine", [0, 1]),
        (
            {"dtype": "fp8", "fp8_recipe": "current"},
            {"mode": "selective", "every": 2},
            "transformer_engine",
            [0],
        ),
        ({"dtype": "fp8", "fp8_recipe": "current"}, {"mode": "none"}, "transformer_engine", []),
    ],
)
def test_every_pair_the_schema_accepts_starts_on_the_gpu_as_before(
    monkeypatch, tiny, precision, checkpointing, backend, blocks
):
    # The trainer's own FP8 + op refusal moved into the recipe schema; for every recipe the schema
    # accepts, the choices the trainer makes at start are what they were: the backend (op-level
    # checkpointing needs the pure-PyTorch block, anything else gets Transformer Engine on a GPU where
    # it imports) and the blocks that recompute.
    data = tiny.model_dump()
    data.update(precision=precision, activation_checkpointing=checkpointing)
    recipe = Recipe.model_validate(data)
    fake = types.SimpleNamespace(name="transformer_engine")
    monkeypatch.setattr(model_module, "transformer_engine_backend", lambda: fake)
    ac = recipe.activation_checkpointing
    assert select_backend("cuda", needs_pytorch_ops=is_op_level(ac)).name == backend
    assert checkpointed_blocks(ac, recipe.model.layers) == blocks


def test_sagemaker_hyperparameters_with_fp8_and_the_op_policy_stop_at_load_naming_the_field(tiny, tmp_path):
    # What the launcher could still be handed by hand (a hyperparameters file written outside
    # trainstack): the trainer reads it through the same schema, so it stops before building anything.
    encoded = to_hyperparameters(tiny)
    encoded.update(
        {
            "precision.dtype": '"fp8"',
            "precision.fp8_recipe": '"current"',
            "activation_checkpointing.mode": '"selective"',
            "activation_checkpointing.policy": '"op"',
        }
    )
    path = tmp_path / "hyperparameters.json"
    path.write_text(json.dumps(encoded))
    with pytest.raises(
        RecipeError, match="activation_checkpointing.policy: op cannot run with precision.dtype fp8"
    ):
        recipe_from_json(path)
