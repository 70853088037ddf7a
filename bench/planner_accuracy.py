"""Planner accuracy: predicted vs measured memory and throughput for every published case, the
calibration fit, and its leave-one-out errors.

    .venv/bin/python bench/planner_accuracy.py            # tables: memory, throughput (fit, LOO), bounds
    .venv/bin/python bench/planner_accuracy.py --fit      # refit; print the constants for calibration.py
    .venv/bin/python bench/planner_accuracy.py --check    # exit 1 if calibration.py is not today's fit
    .venv/bin/python bench/planner_accuracy.py --json

Cases: bench/calibration_published.yaml (the shared ../shared/calibration/published.yaml plus cases
added with their sources; the bench checks that every shared case is there unchanged). Each case is
mapped onto the planner's explicit knobs, not onto a recipe (the published runs used trainers and
settings our recipes do not have):

- GPU: H100 -> ml.p5.48xlarge, H200 -> ml.p5en.48xlarge, B200 -> ml.p6-b200.48xlarge (the catalogue's
  peaks and links). The torchtitan and torchao H100s were Meta's 500 W HBM2e parts and the torchao
  B200s "power limited", so each kind of GPU gets its own fitted GEMM efficiency; plans use the H200's
  (the only runs at rated power), and the throttled ones set the slow end of every range.
- activation_checkpointing: "selective-op" -> torchtitan's op-level policy
  (ActivationPolicy.torchtitan_op_selective: trainstack.planner.trainer_memory's torchtitan terms),
  "full" -> every block recomputed, absent or "none" -> no recompute.
- Loss: these trainers materialise the micro-batch's logits whole (one chunk = micro_batch x seq_len).
- precision: fp8-tensorwise and fp8-current-scaling -> fp8 "current"; mxfp8 -> "mxfp8".
  fp8_all_gather: parameters gathered in 1 byte instead of 2. torchtitan shards the embedding and the
  output head as FSDP units of their own (root_unit=False), so only the embedding's traffic is exposed.
- Recompute: their blocks are pure PyTorch under torch's non-reentrant checkpoint, which stops before
  replaying fc2 (backend "pytorch" for trainer_memory.full_recompute_share; our trainer's TE block
  replays all four matmuls).
- global batch: as published, else micro_batch x GPUs (no accumulation).
- Memory: torchtitan reports torch.cuda.max_memory_reserved(), which excludes the CUDA context and
  NCCL's own buffers, so the comparison uses the planner's allocator peak (peak less those two).

The fit: the constants named in trainstack.planner.calibration.PRIORS minimise the sum of squared log
errors over the `fit` cases (each weighted as a 5% measurement spread) plus a weak pull toward each
constant's prior. Leave-one-out: the fit is repeated without each case in turn and that case
predicted; those errors (not the in-sample ones) are the plan's ranges. Megatron's runs (`upper-bound`)
are not fitted: the planner must stay at or below them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainstack.planner import (  # noqa: E402
    CALIBRATION,
    ActivationPolicy,
    Calibration,
    memory_breakdown,
    memory_plan,
    throughput,
)
from trainstack.planner import calibration as calibration_module  # noqa: E402
from trainstack.planner.trainer_memory import LOSS_BYTES  # noqa: E402
from trainstack.recipes.hardware import INSTANCES  # noqa: E402
from trainstack.recipes.schema import ModelShape  # noqa: E402

SHARED = ROOT.parent / "shared" / "calibration" / "published.yaml"
CASES = Path(__file__).resolve().parent / "calibration_published.yaml"
GPU_TO_INSTANCE = {"H100": "ml.p5.48xlarge", "H200": "ml.p5en.48xlarge", "B200": "ml.p6-b200.48xlarge"}
FP8_RECIPES = {"fp8-tensorwise": "current", "fp8-current-scaling": "current", "mxfp8": "mxfp8"}
MEASUREMENT_SPREAD = 0.05  # the weight of one case in the fit: a 5% spread between runs and versions

# Figures the AWS guide quotes for its 1B MXFP8 example at 8K tokens (shared README section 3). Its
# trainer, loss and whether tokens/s is per GPU are not published: shown for context, not scored.
GUIDE_ANCHORS = [
    {"id": "aws-guide-1b-mxfp8-b1-no-ckpt", "micro_batch": 1, "mode": "none", "memory_gb": 15.5, "tps": 6000},
    {"id": "aws-guide-1b-mxfp8-b16-ckpt", "micro_batch": 16, "mode": "full", "memory_gb": 22.8, "tps": 51000},
]
LLAMA_1B = ModelShape(
    layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied_embeddings=True
)


def load_cases(path: Path = CASES) -> list[dict]:
    cases = yaml.safe_load(path.read_text())["cases"]
    if SHARED.is_file():  # the copy must carry every shared case, field for field (plus its role)
        mine = {c["id"]: {k: v for k, v in c.items() if k != "role"} for c in cases}
        for shared in yaml.safe_load(SHARED.read_text())["cases"]:
            if mine.get(shared["id"]) != shared:
                raise SystemExit(f"{path}: case {shared['id']} differs from {SHARED} (or is missing)")
    return cases


def policy_of(case: dict) -> ActivationPolicy:
    mode = case.get("activation_checkpointing", "none")
    if mode == "selective-op":
        return ActivationPolicy.torchtitan_op_selective()
    if mode == "full":
        return ActivationPolicy.full()
    if mode == "none":
        return ActivationPolicy.none()
    raise SystemExit(f"case {case['id']}: unknown activation_checkpointing {mode!r}")


@functools.cache
def _shape(fields: tuple[tuple[str, object], ...]) -> ModelShape:
    return ModelShape(**dict(fields))


def shape_of(case: dict) -> ModelShape:
    """The case's model, validated once: a fit predicts every case tens of thousands of times, and
    validating the shape each time was a quarter of the leave-one-out's time."""
    return _shape(tuple(sorted(case["model"].items())))


def knobs(case: dict) -> dict:
    par = case.get("parallelism", {})
    tp, cp = par.get("tp", 1), par.get("cp", 1)
    mb = case["micro_batch"]
    return dict(
        seq_len=case["seq_len"],
        micro_batch=mb,
        shard_group=par.get("fsdp_shard", case["gpus"]),
        tp=tp,
        cp=cp,
        policy=policy_of(case),
    )


def predict_tps(case: dict, cal: Calibration, limits: bool = False) -> float:
    instance = INSTANCES[GPU_TO_INSTANCE[case["gpu"]]]
    k = knobs(case)
    precision = case["precision"]
    return throughput(
        shape_of(case),
        instance,
        global_batch=case.get("global_batch", k["micro_batch"] * case["gpus"] // (k["tp"] * k["cp"])),
        world_size=case["gpus"],
        dtype="bf16" if precision == "bf16" else "fp8",
        fp8_recipe=FP8_RECIPES.get(precision),
        compile=bool(case.get("compile", False)),
        loss_chunk_tokens=k["micro_batch"] * k["seq_len"],
        param_gather_bytes=1 if case.get("fp8_all_gather") else 2,
        root_unit=False,  # torchtitan and Megatron shard the embedding and the head as their own units
        # torchtitan's and torchao's blocks are pure PyTorch under torch's non-reentrant checkpoint
        # (fc2 not replayed: trainer_memory.full_recompute_share); Megatron's cases do not recompute
        backend="pytorch",
        calibration=cal,
        limits=limits,
        # the fit: each case at its own hardware's efficiency; upper bounds: as a plan would be made
        efficiency=cal.measured_efficiency(case["gpu"]) if not limits else None,
        **k,
    ).tokens_per_sec_per_gpu


# torchtitan's loss: `cross_entropy(pred.flatten(0, 1).float(), labels)` over the whole micro-batch's
# logits. Eager (torchtitan 9dec370, 2024-12-26, the H100 runs: train.py leaves it uncompiled, "compiling
# loss function causes CUDA errors, turning off for now") it holds what our chunked loss holds per logit
# (trainer_memory.LOSS_BYTES: the FP32 log-softmax and the FP32 gradients). From torchtitan e10cb94
# ("Move output .float() to loss fn and compile it if compiling") it is compiled with the model, as at
# e7c0cae (2025-06-13, the H200 runs: torchtitan/components/loss.py, build_cross_entropy_loss): Inductor
# fuses the upcast, log-softmax and its backward, so the BF16 logits and their BF16 gradient are what is
# held (4 bytes per logit; estimate: the fused kernels materialise no FP32 copy).
COMPILED_LOSS_SOURCES = ("benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md",)
COMPILED_LOSS_BYTES = 4


def loss_bytes_per_logit(case: dict) -> float:
    compiled = case.get("compile") and any(s in case.get("source", "") for s in COMPILED_LOSS_SOURCES)
    return COMPILED_LOSS_BYTES if compiled else LOSS_BYTES


def predict_memory(case: dict) -> dict:
    instance = INSTANCES[GPU_TO_INSTANCE[case["gpu"]]]
    k = knobs(case)
    # Gradient accumulation as published (global batch / micro-batch x data-parallel GPUs; none when
    # no global batch is published): without it no gradient exists at the peak (issue 39's trace).
    data_parallel = case["gpus"] // (k["tp"] * k["cp"])
    accumulation = max(
        1, case.get("global_batch", k["micro_batch"] * data_parallel) // (k["micro_batch"] * data_parallel)
    )
    parts = memory_breakdown(
        shape_of(case),
        instance.gpu,
        loss_chunk_tokens=k["micro_batch"] * k["seq_len"],
        grad_accum=accumulation,
        loss_bytes_per_logit=loss_bytes_per_logit(case),
        **k,
    )
    mem = memory_plan(parts, instance.gpu)
    return {"peak_gib": mem.peak_gib, "allocator_peak_gib": mem.allocator_peak_gib}


# --- The fit --------------------------------------------------------------------------------------


# The fit works on an unbounded scale: logit for fractions (a GEMM cannot beat its peak), log otherwise.
def to_scale(name: str, value: float) -> float:
    return math.log(value / (1 - value)) if name in calibration_module.FRACTIONS else math.log(value)


def from_scale(name: str, x: float) -> float:
    return 1 / (1 + math.exp(-x)) if name in calibration_module.FRACTIONS else math.exp(x)


def _calibration(x: list[float], names: tuple[str, ...], base: Calibration) -> Calibration:
    return dataclasses.replace(base, **{n: from_scale(n, v) for n, v in zip(names, x, strict=True)})


def objective(x: list[float], cases: list[dict], names: tuple[str, ...], base: Calibration) -> float:
    cal = _calibration(x, names, base)
    data = sum(
        (math.log(predict_tps(c, cal) / c["measured"]["tokens_per_sec_per_gpu"]) / MEASUREMENT_SPREAD) ** 2
        for c in cases
    )
    prior = 0.0
    for name, v in zip(names, x, strict=True):
        mean, sd = calibration_module.PRIORS[name]
        prior += ((v - to_scale(name, mean)) / sd) ** 2
    return data + prior


def nelder_mead(f, x0: list[float], step: float = 0.3, iterations: int = 4000, tol: float = 1e-9):
    """Minimise f from x0 (plain Nelder-Mead; no third-party dependency)."""
    n = len(x0)
    simplex = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) <= tol * (1 + abs(values[0])):
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def toward(t: float, worst=worst, centroid=centroid) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, worst, strict=True)]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best point
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (p - b) for b, p in zip(best, q, strict=True)] for q in simplex[1:]
                ]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    i = min(range(n + 1), key=values.__getitem__)
    return simplex[i], values[i]


def fit(cases: list[dict], base: Calibration = CALIBRATION) -> Calibration:
    """The fitted constants of `base` refitted on `cases`, starting from the priors (so the same cases
    always give the same constants, whatever calibration.py holds now)."""
    names = calibration_module.FITTED
    x0 = [to_scale(n, calibration_module.PRIORS[n][0]) for n in names]
    x, _ = nelder_mead(lambda x: objective(x, cases, names, base), x0)
    # restart once from the result: Nelder-Mead can stall on a face of the simplex
    x, _ = nelder_mead(lambda x: objective(x, cases, names, base), x, step=0.1)
    return _calibration(x, names, base)


def fit_cases(cases: list[dict]) -> list[dict]:
    return [
        c for c in cases if c.get("role") == "fit" and c.get("measured", {}).get("tokens_per_sec_per_gpu")
    ]


def leave_one_out(cases: list[dict], base: Calibration) -> dict[str, float]:
    """case id -> ln(measured / predicted) when the case is left out of the fit."""
    errors = {}
    for i, case in enumerate(cases):
        cal = fit(cases[:i] + cases[i + 1 :], base)
        errors[case["id"]] = math.log(case["measured"]["tokens_per_sec_per_gpu"] / predict_tps(case, cal))
    return errors


# --- Output ---------------------------------------------------------------------------------------


def pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def rows(cases: list[dict], cal: Calibration, loo: dict[str, float] | None) -> list[dict]:
    out = []
    for case in cases:
        measured = case.get("measured", {})
        row = {"id": case["id"], "role": case.get("role"), "gpu": case["gpu"], "precision": case["precision"]}
        row["checkpointing"] = case.get("activation_checkpointing", "none")
        row["compile"] = case.get("compile")
        row.update(predict_memory(case))
        row["measured_peak_gib"] = measured.get("peak_memory_gib")
        if row["measured_peak_gib"]:
            row["memory_error"] = row["allocator_peak_gib"] / row["measured_peak_gib"] - 1
        row["tokens_per_sec_per_gpu"] = predict_tps(case, cal)
        row["planned_tokens_per_sec_per_gpu"] = predict_tps(case, cal, limits=True)  # with cap and bound
        row["measured_tokens_per_sec_per_gpu"] = measured.get("tokens_per_sec_per_gpu")
        if row["measured_tokens_per_sec_per_gpu"]:
            measured_tps = row["measured_tokens_per_sec_per_gpu"]
            row["throughput_error"] = row["tokens_per_sec_per_gpu"] / measured_tps - 1
            if loo and case["id"] in loo:
                row["loo_error"] = math.exp(-loo[case["id"]]) - 1  # predicted / measured - 1
        out.append(row)
    return out


def guide_rows(cal: Calibration) -> list[dict]:
    b200 = INSTANCES["ml.p6-b200.48xlarge"]
    out = []
    for anchor in GUIDE_ANCHORS:
        policy = ActivationPolicy.full() if anchor["mode"] == "full" else ActivationPolicy.none()
        mb = anchor["micro_batch"]
        common = dict(seq_len=8192, micro_batch=mb, shard_group=8, policy=policy)
        parts = memory_breakdown(LLAMA_1B, b200.gpu, loss_chunk_tokens=8192, **common)
        thr = throughput(
            LLAMA_1B,
            b200,
            global_batch=mb * 8,
            world_size=8,
            dtype="fp8",
            fp8_recipe="mxfp8",
            compile=False,
            loss_chunk_tokens=8192,
            calibration=cal,
            **common,
        )
        out.append(
            {
                **anchor,
                "peak_gb": sum(parts.values()) * 2**30 / 1e9,
                "predicted_tps": thr.tokens_per_sec_per_gpu,
            }
        )
    return out


def print_tables(cases: list[dict], cal: Calibration, loo: dict[str, float] | None) -> None:
    table = rows(cases, cal, loo)
    print(f"cases: {CASES}")
    print("\nPeak memory per GPU (GiB). Compared: allocator peak (what torch reports) vs measured.")
    header = f"{'case':60} {'ckpt':13} {'plan total':>10} {'plan alloc':>10} {'measured':>9} {'error':>7}"
    print(header)
    print("-" * len(header))
    for r in table:
        if r["measured_peak_gib"]:
            print(
                f"{r['id']:60} {r['checkpointing']:13} {r['peak_gib']:10.1f} {r['allocator_peak_gib']:10.1f} "
                f"{r['measured_peak_gib']:9.1f} {pct(r.get('memory_error')):>7}"
            )
    errors = [abs(r["memory_error"]) for r in table if "memory_error" in r]
    print(
        f"memory: {len(errors)} cases, max |error| {max(errors):.1%}, "
        f"{sum(e <= 0.10 for e in errors)}/{len(errors)} within 10%"
    )

    print("\nThroughput (tokens/s per GPU), fitted cases: in-sample error and leave-one-out (LOO) error.")
    header = f"{'case':60} {'plan':>8} {'measured':>9} {'fit err':>8} {'LOO err':>8}"
    print(header)
    print("-" * len(header))
    for r in table:
        if r["role"] == "fit" and r["measured_tokens_per_sec_per_gpu"]:
            print(
                f"{r['id']:60} {r['tokens_per_sec_per_gpu']:8,.0f} "
                f"{r['measured_tokens_per_sec_per_gpu']:9,.0f} "
                f"{pct(r.get('throughput_error')):>8} {pct(r.get('loo_error')):>8}"
            )
    fitted = [r for r in table if r["role"] == "fit" and "throughput_error" in r]
    ins = [abs(r["throughput_error"]) for r in fitted]
    print(f"in-sample: {len(ins)} cases, max |error| {max(ins):.1%}, RMS {_rms(ins):.1%}")
    if loo:
        out = [abs(r["loo_error"]) for r in fitted if "loo_error" in r]
        lo, hi = min(loo.values()), max(loo.values())
        print(
            f"leave-one-out: max |error| {max(out):.1%}, RMS {_rms(out):.1%}; "
            f"ln(measured/predicted) in [{lo:+.3f}, {hi:+.3f}] "
            f"-> plan ranges x[{math.exp(lo):.2f}, {math.exp(hi):.2f}]"
        )

    print("\nUpper bounds (Megatron-Core, TP/PP-tuned; not fitted): the plan must not exceed them.")
    header = f"{'case':60} {'plan':>8} {'published':>10} {'plan/published':>15}"
    print(header)
    print("-" * len(header))
    for r in table:
        if r["role"] == "upper-bound":
            ratio = r["planned_tokens_per_sec_per_gpu"] / r["measured_tokens_per_sec_per_gpu"]
            print(
                f"{r['id']:60} {r['planned_tokens_per_sec_per_gpu']:8,.0f} "
                f"{r['measured_tokens_per_sec_per_gpu']:10,.0f} {ratio:15.2f}"
            )

    print("\nAWS guide 1B MXFP8 anchors (trainer, loss and tokens/s scope unpublished; context, not scored).")
    header = f"{'anchor':34} {'plan GB':>8} {'guide GB':>9} {'plan tok/s':>11} {'guide tok/s':>12}"
    print(header)
    print("-" * len(header))
    for g in guide_rows(cal):
        print(
            f"{g['id']:34} {g['peak_gb']:8.1f} {g['memory_gb']:9.1f} "
            f"{g['predicted_tps']:11,.0f} {g['tps']:12,}"
        )


def _rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def constants_text(cal: Calibration, loo_low: float, loo_high: float) -> str:
    """The lines of trainstack/planner/calibration.py that hold the fit."""
    lines = ["FIT = dict("]
    lines += [f"    {n}={getattr(cal, n):.4g}," for n in calibration_module.FITTED]
    lines.append(")")
    lines.append(f"LOO_LOG_ERROR: tuple[float, float] = ({loo_low:.3f}, {loo_high:.3f})")
    return "\n".join(lines)


CALIBRATION_PY = ROOT / "trainstack" / "planner" / "calibration.py"


def write_constants(text: str) -> None:
    """Replace the FIT dict and the LOO_LOG_ERROR line of calibration.py with `text`."""
    source = CALIBRATION_PY.read_text()
    start = source.index("FIT = dict(")
    end = source.index(")\n", start) + 2
    fit_text, loo_line = text.rsplit("\n", 1)
    source = source[:start] + fit_text + "\n" + source[end:]
    start = source.index("LOO_LOG_ERROR: tuple[float, float] = (")
    end = source.index("\n", start)
    CALIBRATION_PY.write_text(source[:start] + loo_line + source[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=CASES)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--fit", action="store_true", help="refit and print the constants for calibration.py")
    group.add_argument("--check", action="store_true", help="exit 1 unless calibration.py holds today's fit")
    group.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--write", action="store_true", help="with --fit: write the constants into calibration.py"
    )
    parser.add_argument("--no-loo", action="store_true", help="skip the leave-one-out fits (faster)")
    args = parser.parse_args()
    cases = load_cases(args.cases)
    train = fit_cases(cases)
    if args.fit or args.check:
        cal = fit(train)
        loo = leave_one_out(train, cal)
        text = constants_text(cal, min(loo.values()), max(loo.values()))
        if args.fit:
            print(text)
            if args.write:
                write_constants(text)
                print(f"wrote {CALIBRATION_PY}")
            return 0
        stored = constants_text(CALIBRATION, *calibration_module.LOO_LOG_ERROR)
        if stored != text:
            print(f"calibration.py differs from today's fit:\n--- stored\n{stored}\n--- fit\n{text}")
            return 1
        print("calibration.py holds today's fit")
        return 0
    loo = None if args.no_loo else leave_one_out(train, CALIBRATION)
    if args.json:
        payload = {"cases": rows(cases, CALIBRATION, loo), "guide": guide_rows(CALIBRATION)}
        print(json.dumps(payload, indent=2))
        return 0
    print_tables(cases, CALIBRATION, loo)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
