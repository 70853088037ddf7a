"""Trainer speed and memory on one NVIDIA GPU, through the trainer's own modules, against the plan.

    python bench/trainer_gpu.py --json out.json    # one GPU, under 8 minutes on an H200
    python bench/trainer_gpu.py --smoke            # CPU, tiny shape: the same code path (CI runs it)

It runs as is on the GPU machine this workplace lends (one H200, torch 2.11, no network, no
Transformer Engine, no pydantic): carry `build/wheelhouse` (made by bench/wheelhouse.py) and the
pydantic the trainer's recipe schema needs is unpacked from it. The exact device command is in
docs/benchmarks.md (## Trainer).

Each section prints its rows as it finishes (and goes on after a section fails, saying why):

  layers         8B width (hidden 4096, ffn 14336, 32/8 heads, vocab 128256), 8K tokens, BF16, no
                 checkpointing, blocks compiled: 2 and 10 layers. Step time, tokens/s, MFU (PaLM
                 FLOPs, trainstack.planner.flops_per_token, against the GPU's dense peak), peak memory,
                 the measured per-component memory against the planner's breakdown for the same shape,
                 and per-block slopes (10 minus 2, over 8) of time and memory against the plan's.
  compile        the 2-layer case eager, against compiled.
  checkpointing  4 layers, eager: none, full and op-level selective; time, peak, and the activation
                 memory held after forward per block against trainstack.planner.trainer_memory.
  attention      causal GQA attention at the block's shape, forward + backward: cuDNN against flash
                 (and the trainer's priority order), then the 2-layer model with each.
  long_context   128K tokens, full checkpointing, 2 layers (1 if 2 do not fit), against the plan.
  fp8_gemm       Hopper or newer: torch._scaled_mm (FP8 e4m3, per-tensor scales) against BF16 at the
                 block's exact GEMM shapes (forward, input gradient, weight gradient): an upper bound
                 on what FP8 GEMMs can buy (no quantization, no casts), with the share of the step
                 they are.
  saved_tensors  one eager block's saved-for-backward bytes on this device (bench/saved_tensors.py)
                 for none / full / op against trainstack.planner.trainer_memory.

The planner is asked about a one-node recipe with shard_group 1 (each GPU holds the whole model, as
the one benchmark GPU does). The planner models shard_group 1 as unsharded (BF16 copies of every
block resident) while FSDP2 over a world of one gathers its units one or two at a time; the rows
show both that planner line and trainstack.planner.trainer_memory.fsdp_units_in_flight_bytes. Record the
results in docs/benchmarks.md (## Trainer).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO / "bench", REPO / "training_image", REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from wheelhouse import make_importable  # noqa: E402

PYDANTIC_FROM = make_importable("pydantic")  # before anything imports the recipe schema

import torch.distributed as dist  # noqa: E402
from saved_tensors import count_saved_bytes  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from trainer.distributed.parallel import build_mesh, shard_model  # noqa: E402
from trainer.metrics.throughput import GIB, detected_gpu, peak_tflops  # noqa: E402
from trainer.models.activation_checkpointing import apply_activation_checkpointing, recompute_function  # noqa: E402
from trainer.models.model import (  # noqa: E402
    Block,
    build_model,
    compile_blocks,
    pytorch_backend,
    rotary_tables,
    transformer_engine_backend,
)
from trainer.optim import build_optimizer  # noqa: E402

from trainstack.planner import (  # noqa: E402
    flops_per_token,
    plan,
    trainer_memory,  # noqa: E402
)
from trainstack.recipes.schema import ActivationCheckpointing, ModelShape, Recipe  # noqa: E402

INSTANCE_FOR_GPU = {"B200": "ml.p6-b200.48xlarge", "H100": "ml.p5.48xlarge", "H200": "ml.p5en.48xlarge"}
SLICE_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "rope_theta": 500000.0}
SMOKE_SHAPE = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 176, "vocab": 256, "rope_theta": 10000.0}
AC = {
    "none": ActivationCheckpointing(mode="none"),
    "full": ActivationCheckpointing(mode="full"),
    "op": ActivationCheckpointing(mode="selective", policy="op"),
}


class Settings:
    """Sizes for a GPU run, or for the CPU smoke run (same sections, tiny shapes, few steps)."""

    def __init__(self, smoke: bool, steps: int, warmup: int):
        self.smoke = smoke
        self.shape = SMOKE_SHAPE if smoke else SLICE_8B
        self.seq = 64 if smoke else 8192
        self.long_seq = 256 if smoke else 131072
        self.layer_pair = (2, 3) if smoke else (2, 10)
        self.ckpt_layers = 2 if smoke else 4
        self.steps = min(steps, 2) if smoke else steps
        self.warmup = min(warmup, 1) if smoke else warmup
        self.long_steps = 1 if smoke else 3
        self.compile = not smoke  # inductor on CPU takes minutes; the smoke run stays eager


# --- recipes and the plan -------------------------------------------------------------------------
def bench_recipe(shape: dict, layers: int, seq_len: int, ac: str, instance_type: str) -> Recipe:
    """The per-GPU configuration as a recipe the planner understands: one node, shard_group 1 (each
    GPU holds the whole model, as the single benchmark GPU does), micro-batch 1."""
    return Recipe.model_validate(
        {
            "name": "bench-trainer-gpu",
            "model": {**shape, "layers": layers},
            "training": {
                "seq_len": seq_len,
                "micro_batch": 1,
                "global_batch": 8,
                "steps": 1000,
                "lr": 3.0e-3,
            },
            "precision": {"dtype": "bf16"},
            "activation_checkpointing": AC[ac].model_dump(),
            "parallelism": {"shard_group": 1},
            "compute": {"instance_type": instance_type, "instance_count": 1},
        }
    )


def planned(recipe: Recipe) -> dict:
    p = plan(recipe)
    return {
        "planned_allocator_peak_gib": p.memory.allocator_peak_gib,
        "planned_total_gib": p.memory.peak_gib,
        "planned_breakdown_gib": p.memory.breakdown,
        "planned_tokens_per_sec_per_gpu": p.throughput.tokens_per_sec_per_gpu,
        "planned_mfu": p.throughput.mfu,
    }


# --- one training configuration through the trainer's modules --------------------------------------
def synthetic_batch(
    vocab: int, seq: int, step: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable bigram stream (each token's successor is fixed by one seeded permutation)."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234)).tolist()
    tokens = [int(torch.randint(0, vocab, (1,), generator=torch.Generator().manual_seed(step)))]
    for _ in range(seq):
        tokens.append(successor[tokens[-1]])
    window = torch.tensor(tokens, device=device).unsqueeze(0)
    return window[:, :-1], window[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def measure_training(
    recipe: Recipe,
    backend,
    device: torch.device,
    mesh,
    *,
    compiled: bool,
    warmup: int,
    steps: int,
    sdpa_backends: list | None = None,
) -> dict:
    """Train `warmup + steps` optimizer steps (micro-batch 1) and time the last `steps`; measure the
    memory components on the first two steps (CUDA allocator figures; zeros on CPU)."""
    tr, shape = recipe.training, recipe.model
    torch.manual_seed(0)
    model = build_model(shape, tr.seq_len, backend, tr.loss_chunk_tokens)
    apply_activation_checkpointing(model, recipe.activation_checkpointing)
    if sdpa_backends is not None:
        for block in model.layers:
            block.attention.core.sdpa_backends = list(sdpa_backends)
    if compiled:
        compile_blocks(model)
    shard_model(model, mesh)
    model.to_empty(device=device)
    model.init_weights()
    optimizer = build_optimizer(model, tr, device.type)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    memory: dict[str, int] = {"parameters": _allocated(device)}
    losses, started = [], None
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            started = time.perf_counter()
        inputs, targets = synthetic_batch(shape.vocab, tr.seq_len, step, device)
        before = _allocated(device)
        if step == 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loss = model(inputs, targets)
        if step == 1:
            memory["held_after_forward"] = _allocated(device) - before
        loss.backward()
        if step == 0:
            memory["gradients"] = _allocated(device) - before
        if step == 1 and device.type == "cuda":
            memory["step_peak_over_states"] = torch.cuda.max_memory_allocated(device) - before
        torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        after_backward = _allocated(device)
        optimizer.step()
        if step == 0:
            memory["optimizer_states"] = _allocated(device) - after_backward
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs: the step is done
    elapsed = time.perf_counter() - started
    tokens_per_sec = tr.micro_batch * tr.seq_len * steps / elapsed
    flops = flops_per_token(shape, tr.seq_len)
    peak, peak_of = peak_tflops(recipe, device)
    result = {
        "layers": shape.layers,
        "seq_len": tr.seq_len,
        "checkpointing": _ac_name(recipe.activation_checkpointing),
        "compiled": compiled,
        "step_time_s": elapsed / steps,
        "tokens_per_sec_per_gpu": tokens_per_sec,
        "tflops_per_gpu": tokens_per_sec * flops / 1e12,
        "mfu": tokens_per_sec * flops / 1e12 / peak,
        "mfu_against": peak_of,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB
        if device.type == "cuda"
        else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda" else None,
        "measured_gib": {k: v / GIB for k, v in memory.items()},
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    del model, optimizer, loss
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return result


def _ac_name(ac: ActivationCheckpointing) -> str:
    return "op" if ac.mode == "selective" and ac.policy == "op" else ac.mode


def compare_components(row: dict, recipe: Recipe) -> dict:
    """The measured components next to the planner's, with what trainer_memory says for the units the
    planner models differently at shard_group 1."""
    m, tr = recipe.model, recipe.training
    tokens = tr.micro_batch * tr.seq_len
    planned_gib = row["planned_breakdown_gib"]
    per_block = trainer_memory.block_saved_bytes(m, row["checkpointing"])
    # After forward: every block's saved activations, the units still gathered (last block, head),
    # and what the final norm and the chunked loss keep (the last block's output and rstd, the norm's
    # output that each loss chunk recomputes its logits from).
    final_norm_and_loss = tokens * (4 * m.hidden + 4)
    held_model = (
        m.layers * per_block * tokens
        + trainer_memory.gathered_parameter_bytes_after_forward(m)
        + final_norm_and_loss
    ) / GIB
    measured = row["measured_gib"]
    return {
        "parameters": (measured.get("parameters"), planned_gib.get("parameters (sharded FP32)")),
        "gradients": (measured.get("gradients"), planned_gib.get("gradients (sharded FP32)")),
        "optimizer_states": (
            measured.get("optimizer_states"),
            planned_gib.get("optimizer states (AdamW FP32)"),
        ),
        "held_after_forward": (
            measured.get("held_after_forward"),
            planned_gib.get("activations (saved)", 0) + planned_gib.get("unsharded layers in flight", 0),
        ),
        "held_after_forward_trainer_memory": (measured.get("held_after_forward"), held_model),
    }


# --- sections --------------------------------------------------------------------------------------
class Bench:
    def __init__(self, settings: Settings, device: torch.device, mesh, backend, instance_type: str):
        self.s, self.device, self.mesh, self.backend = settings, device, mesh, backend
        self.instance_type = instance_type
        self.sections: dict[str, dict] = {}

    def recipe(self, layers: int, seq: int | None = None, ac: str = "none") -> Recipe:
        return bench_recipe(self.s.shape, layers, seq or self.s.seq, ac, self.instance_type)

    def train_row(self, recipe: Recipe, compiled: bool, steps: int | None = None, **kwargs) -> dict:
        op_level = _ac_name(recipe.activation_checkpointing) == "op"  # needs the pure-PyTorch block
        row = measure_training(
            recipe,
            pytorch_backend() if op_level else self.backend,
            self.device,
            self.mesh,
            compiled=compiled,
            warmup=self.s.warmup,
            steps=steps or self.s.steps,
            **kwargs,
        )
        row.update(planned(recipe))
        measured_peak = row["peak_reserved_gib"]
        if measured_peak:
            planned_peak = row["planned_allocator_peak_gib"]
            row["planner_peak_error"] = (planned_peak - measured_peak) / measured_peak
        row["components_gib_measured_vs_planned"] = compare_components(row, recipe)
        return row

    def run(self, name: str, section: Callable[[], dict]) -> None:
        print(f"## {name}", flush=True)
        started = time.perf_counter()
        error = None
        try:
            result = section()
        except Exception as exc:  # a failed section must not cost the rest of the device run
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"[:2000]
        if error is not None:  # outside the except block, so the traceback's frames are gone
            result = {}
            print(f"# {name} failed: {error[:300]}", flush=True)
            _free(self.device)
        result["error"] = error
        result["seconds"] = time.perf_counter() - started
        self.sections[name] = result

    def layers(self) -> dict:
        rows = [self.train_row(self.recipe(layers), self.s.compile) for layers in self.s.layer_pair]
        for row in rows:
            print(format_row(row), flush=True)
        low, high = rows
        span = high["layers"] - low["layers"]
        m = self.recipe(1).model
        tokens = self.s.seq
        planned_slope = (high["planned_allocator_peak_gib"] - low["planned_allocator_peak_gib"]) / span
        states_per_block = m.params_per_layer * 16 / GIB  # FP32 parameter, gradient, Adam m and v
        slope = {
            "time_s_per_block": (high["step_time_s"] - low["step_time_s"]) / span,
            "planned_time_s_per_block": (
                tokens / high["planned_tokens_per_sec_per_gpu"]
                - tokens / low["planned_tokens_per_sec_per_gpu"]
            )
            / span,
            "peak_gib_per_block": _slope(low, high, "peak_allocated_gib", span),
            "planned_peak_gib_per_block": planned_slope,
            "held_after_forward_gib_per_block": _slope_measured(low, high, "held_after_forward", span),
            "trainer_memory_saved_gib_per_block": trainer_memory.block_activation_bytes(m) * tokens / GIB,
            "states_gib_per_block": states_per_block,
        }
        if self.s.compile:  # one graph reused by every block and model, or recompiles (a slowdown)
            slope["dynamo_unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(
            f"# per block ({high['layers']} minus {low['layers']} layers, over {span}): "
            + json.dumps(_rounded(slope)),
            flush=True,
        )
        return {"rows": rows, "slope": slope}

    def compile_comparison(self) -> dict:
        layers = self.s.layer_pair[0]
        rows = [self.train_row(self.recipe(layers), compiled) for compiled in (False, True)]
        for row in rows:
            print(format_row(row), flush=True)
        return {"rows": rows, "speedup": rows[0]["step_time_s"] / rows[1]["step_time_s"]}

    def checkpointing(self) -> dict:
        rows = []
        for ac in ("none", "full", "op"):
            recipe = self.recipe(self.s.ckpt_layers, ac=ac)
            row = self.train_row(recipe, compiled=False)
            m = recipe.model
            row["trainer_memory_saved_gib_per_block"] = (
                trainer_memory.block_saved_bytes(m, ac) * self.s.seq / GIB
            )
            rows.append(row)
            print(format_row(row), flush=True)
        none = rows[0]["step_time_s"]
        return {"rows": rows, "time_vs_none": {r["checkpointing"]: r["step_time_s"] / none for r in rows}}

    def attention(self) -> dict:
        m = self.recipe(1).model
        kernels = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION]}
        kernels["trainer priority"] = list(pytorch_backend().core_attention(m).sdpa_backends)
        micro = {}
        for name, backends in kernels.items():
            try:
                micro[name] = time_attention(
                    m, self.s.seq, backends, self.device, repeat=3 if self.s.smoke else 10
                )
            except RuntimeError as exc:  # this backend cannot run these inputs here
                micro[name] = {"error": str(exc).splitlines()[0][:200]}
            print(f"attention fwd+bwd {name:>16}: {json.dumps(_rounded(micro[name]))}", flush=True)
        model_rows = {}
        for name in ("cudnn", "flash"):
            if "error" in micro[name]:
                continue
            row = self.train_row(
                self.recipe(self.s.layer_pair[0]), compiled=False, sdpa_backends=kernels[name]
            )
            model_rows[name] = row
            print(f"{name:>6}: " + format_row(row), flush=True)
        return {"micro": micro, "model": model_rows}

    def long_context(self) -> dict:
        for layers in (2, 1):
            recipe = self.recipe(layers, seq=self.s.long_seq, ac="full")
            row, out_of_memory = None, None
            try:
                row = self.train_row(recipe, compiled=False, steps=self.s.long_steps)
            except torch.OutOfMemoryError as exc:
                out_of_memory = str(exc).splitlines()[0]
            if row is not None:
                print(format_row(row), flush=True)
                return {"row": row}
            print(
                f"# {layers} layers at {self.s.long_seq} tokens: out of memory ({out_of_memory})", flush=True
            )
            _free(self.device)
        raise RuntimeError("out of memory at 1 and 2 layers")

    def fp8_gemm(self) -> dict:
        if self.device.type != "cuda" or torch.cuda.get_device_capability(self.device) < (8, 9):
            return {"skipped": "needs an FP8 GPU (compute capability 8.9+: Hopper, Blackwell)"}
        m = self.recipe(1).model
        rows = gemm_rows(m, self.s.seq, self.device)
        bf16 = sum(r["bf16_ms"] for r in rows)
        fp8 = sum(r["fp8_ms"] for r in rows)
        for r in rows:
            print(
                f"gemm {r['gemm']:>14} {r['shape']}: bf16 {r['bf16_ms']:.3f} ms, fp8 {r['fp8_ms']:.3f} ms",
                flush=True,
            )
        ceiling = time_matmul_ceiling(self.device)
        summary = {
            "block_gemm_bf16_ms": bf16,
            "block_gemm_fp8_ms": fp8,
            "gemm_speedup": bf16 / fp8,
            **ceiling,
        }
        block_time = self.sections.get("layers", {}).get("slope", {}).get("time_s_per_block")
        if block_time and block_time > 0:
            share = min(1.0, bf16 / 1000 / block_time)
            summary["gemm_share_of_block_time"] = share
            summary["step_speedup_upper_bound"] = 1 / ((1 - share) + share * fp8 / bf16)
        print("# " + json.dumps(_rounded(summary)), flush=True)
        return {"rows": rows, "summary": summary}

    def saved_tensors(self) -> dict:
        shape = self.recipe(1).model
        rows = []
        for mode in ("none", "full", "op"):
            measured = count_block(shape, self.s.seq, mode, self.device)
            formula = trainer_memory.block_saved_bytes(shape, mode)
            rows.append(
                {
                    "mode": mode,
                    "measured_bytes_per_token": measured,
                    "trainer_memory_bytes_per_token": formula,
                }
            )
            print(
                f"saved per token, {mode:>4}: measured {measured:.1f} B, trainer_memory {formula} B",
                flush=True,
            )
        return {"rows": rows}


def count_block(shape: ModelShape, seq: int, mode: str, device: torch.device) -> float:
    """Bytes per token one eager block keeps for backward on `device` (bench/saved_tensors.py)."""
    torch.manual_seed(0)
    block = Block(shape, pytorch_backend()).to(device)
    for param in block.parameters():
        torch.nn.init.normal_(param, 0.0, 0.02) if param.ndim > 1 else torch.nn.init.ones_(param)
    block.to(torch.bfloat16)
    if mode != "none":
        block.recompute = recompute_function("pytorch", op_level=mode == "op")
    rope = rotary_tables(shape.head_dim, seq, shape.rope_theta, device)
    saved, out = count_saved_bytes(
        block,
        lambda: torch.randn(1, seq, shape.hidden, device=device, dtype=torch.bfloat16, requires_grad=True),
        extra_args=(rope,),
    )
    out.float().sum().backward()
    del block, out
    return saved.live / seq


def time_attention(m: ModelShape, seq: int, backends: list, device: torch.device, repeat: int) -> dict:
    dtype = torch.bfloat16
    q = torch.randn(1, m.heads, seq, m.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, m.kv_heads, seq, m.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, m.kv_heads, seq, m.head_dim, device=device, dtype=dtype, requires_grad=True)

    def once() -> None:
        with sdpa_kernel(backends, set_priority=True):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()

    once()
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeat):
        once()
    _sync(device)
    ms = (time.perf_counter() - started) / repeat * 1000
    # Causal attention: half the score matrix; forward 2 matmuls, backward about 2.5x forward.
    flops = 3.5 * 4 * m.heads * m.head_dim * seq * seq / 2
    return {"fwd_bwd_ms": ms, "tflops": flops / (ms / 1000) / 1e12}


def _timed(fn: Callable[[], object], device: torch.device, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - started) / repeat * 1000


def gemm_rows(m: ModelShape, tokens: int, device: torch.device) -> list[dict]:
    """BF16 and FP8 time of each of the block's GEMMs: forward (tokens x in -> out), input gradient
    (tokens x out -> in) and weight gradient (out x tokens -> in) of Q/K/V, proj, fc1 and fc2."""
    kv = m.kv_heads * m.head_dim
    linears = {
        "qkv": (m.hidden, m.hidden + 2 * kv),
        "proj": (m.heads * m.head_dim, m.hidden),
        "fc1": (m.hidden, 2 * m.ffn),
        "fc2": (m.ffn, m.hidden),
    }
    one = torch.ones((), device=device, dtype=torch.float32)
    rows = []
    for name, (fan_in, fan_out) in linears.items():
        for kind, (rows_a, inner, cols_b) in {
            "fwd": (tokens, fan_in, fan_out),
            "dgrad": (tokens, fan_out, fan_in),
            "wgrad": (fan_out, tokens, fan_in),
        }.items():
            a = torch.randn(rows_a, inner, device=device, dtype=torch.bfloat16)
            b = torch.randn(cols_b, inner, device=device, dtype=torch.bfloat16)  # used as b.t(): column-major
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            bf16_ms = _timed(lambda a=a, b=b: a @ b.t(), device)
            fp8_ms = _timed(
                lambda a8=a8, b8=b8: torch._scaled_mm(
                    a8, b8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True
                ),
                device,
            )
            rows.append(
                {
                    "gemm": f"{name}.{kind}",
                    "shape": [rows_a, inner, cols_b],
                    "bf16_ms": bf16_ms,
                    "fp8_ms": fp8_ms,
                }
            )
            del a, b, a8, b8
    return rows


def time_matmul_ceiling(device: torch.device, n: int = 8192) -> dict:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = _timed(lambda: a @ b, device, repeat=10)
    return {"bf16_matmul_8192_tflops": 2 * n**3 / (ms / 1000) / 1e12}


# --- output ---------------------------------------------------------------------------------------
def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _slope(low: dict, high: dict, key: str, span: int) -> float | None:
    if low.get(key) is None or high.get(key) is None:
        return None
    return (high[key] - low[key]) / span


def _slope_measured(low: dict, high: dict, key: str, span: int) -> float | None:
    a, b = low["measured_gib"].get(key), high["measured_gib"].get(key)
    return None if a is None or b is None else (b - a) / span


def _rounded(value):
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def format_row(row: dict) -> str:
    text = (
        f"{row['layers']:>3} layers x {row['seq_len']} tokens, ckpt {row['checkpointing']:>4}, "
        f"{'compiled' if row['compiled'] else 'eager':>8}: {row['step_time_s'] * 1000:9.1f} ms/step "
        f"{row['tokens_per_sec_per_gpu']:10.1f} tokens/s  MFU {row['mfu']:.4g} (vs {row['mfu_against']})"
    )
    if row["peak_allocated_gib"] is not None:
        text += f"  peak {row['peak_allocated_gib']:.2f} GiB alloc / {row['peak_reserved_gib']:.2f} reserved"
        text += f", plan {row['planned_allocator_peak_gib']:.2f} ({row['planner_peak_error']:+.1%})"
        comps = {
            k: [round(x, 2) if x is not None else None for x in v]
            for k, v in row["components_gib_measured_vs_planned"].items()
        }
        text += f"\n      measured vs planned GiB: {json.dumps(comps)}"
    else:
        text += f"  plan {row['planned_allocator_peak_gib']:.3g} GiB (no GPU memory figures on CPU)"
    return text


def init_world_of_one(device_type: str, store: Path) -> torch.device:
    if device_type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return device


SECTIONS = ("layers", "compile", "checkpointing", "attention", "long_context", "fp8_gemm", "saved_tensors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny shapes, few steps: the code path only"
    )
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile happens here)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA GPU here; run with --smoke on CPU", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    settings = Settings(args.smoke, args.steps, args.warmup)
    with tempfile.TemporaryDirectory() as scratch:
        device = init_world_of_one("cpu" if args.smoke else "cuda", Path(scratch) / "store")
        try:
            gpu = detected_gpu(device)
            instance_type = INSTANCE_FOR_GPU.get(gpu.name if gpu else "", "ml.p6-b200.48xlarge")
            te = transformer_engine_backend() if device.type == "cuda" else None
            backend = te or pytorch_backend()
            header = {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": platform.node(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)",
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
                "python": platform.python_version(),
                "pydantic": PYDANTIC_FROM,
                "backend": backend.name,
                "shape": settings.shape,
                "seq_len": settings.seq,
                "planner_instance": instance_type,
            }
            print(json.dumps(header), flush=True)
            bench = Bench(settings, device, build_mesh(device.type, 1, 1), backend, instance_type)
            sections = {
                "layers": bench.layers,
                "compile": bench.compile_comparison,
                "checkpointing": bench.checkpointing,
                "attention": bench.attention,
                "long_context": bench.long_context,
                "fp8_gemm": bench.fp8_gemm,
                "saved_tensors": bench.saved_tensors,
            }
            if settings.smoke:
                sections.pop("compile")  # inductor on CPU takes minutes; the GPU run compares it
            for name, section in sections.items():
                if not args.only or name in args.only:
                    bench.run(name, section)
            if args.json:
                args.json.write_text(
                    json.dumps({"header": header, "sections": bench.sections}, indent=1) + "\n"
                )
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    failed = [name for name, section in bench.sections.items() if section.get("error")]
    print(f"# done: {len(bench.sections)} sections, failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
