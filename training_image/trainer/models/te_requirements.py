"""What the trainer needs from Transformer Engine, checked when the image is built.

    python te_requirements.py --at-least 2.8         exit 0 if the installed TE is 2.8 or newer
    python te_requirements.py --check-import         import it (TE's own version-consistency check)
                                                     and check every API the trainer calls exists

The Dockerfile keeps the base image's own TE when it is new enough (the PyTorch 2.9 SageMaker DLC
builds TE 2.8 from source) and builds the pinned one for the target GPUs otherwise. TE 2.8 is the
oldest release with everything below: LayerNormLinear / LayerNormMLP with RMSNorm and SwiGLU,
DotProductAttention with GQA groups and the bshd layout, fused RoPE (attention.rope), the four FP8
recipes the recipes name (MXFP8BlockScaling and Float8BlockScaling included) and distributed.checkpoint.
Importing `transformer_engine.pytorch` runs TE's own check that its metapackage, core library and
PyTorch extension are the same version (transformer_engine/common/__init__.py,
load_framework_extension), which fails the build instead of the first job.

Standard library only until --check-import: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys

MINIMUM = "2.8"
DISTRIBUTIONS = ("transformer_engine", "transformer-engine")
# (module, attribute) pairs trainer.models.model, trainer.models.precision and
# trainer.models.activation_checkpointing use.
REQUIRED_API = (
    ("transformer_engine.pytorch", "LayerNormLinear"),
    ("transformer_engine.pytorch", "LayerNormMLP"),
    ("transformer_engine.pytorch", "Linear"),
    ("transformer_engine.pytorch", "RMSNorm"),
    ("transformer_engine.pytorch", "DotProductAttention"),
    ("transformer_engine.pytorch.attention.rope", "apply_rotary_pos_emb"),
    ("transformer_engine.pytorch.distributed", "checkpoint"),
    ("transformer_engine.common.recipe", "DelayedScaling"),
    ("transformer_engine.common.recipe", "Float8CurrentScaling"),
    ("transformer_engine.common.recipe", "Float8BlockScaling"),
    ("transformer_engine.common.recipe", "MXFP8BlockScaling"),
)

# Constructor keywords trainer.models.model passes (the Q/K/V bias of Qwen2-shaped models, the shape's RMSNorm
# epsilon, TE's deferred allocation on the meta device): a release that renamed one would fail the
# first job, so the build checks them too.
REQUIRED_ARGUMENTS = (
    ("LayerNormLinear", ("eps", "bias", "normalization", "device")),
    ("LayerNormMLP", ("eps", "bias", "normalization", "activation", "device")),
    ("Linear", ("bias", "device")),
    ("RMSNorm", ("eps", "device")),
    ("DotProductAttention", ("num_gqa_groups", "attention_dropout", "qkv_format", "attn_mask_type")),
)


def parse_version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: '2.8.0+4e2fa9c' -> (2, 8, 0)."""
    match = re.match(r"\d+(\.\d+)*", text.strip())
    if not match:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def at_least(version: str, minimum: str) -> bool:
    have, need = parse_version(version), parse_version(minimum)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))


def installed_version() -> str | None:
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def missing_api() -> list[str]:
    missing = []
    for module_name, attribute in REQUIRED_API:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{module_name} ({exc})")
            continue
        if not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute}")
    te = importlib.import_module("transformer_engine.pytorch")
    if not any(hasattr(te, name) for name in ("autocast", "fp8_autocast")):  # autocast since TE 2.9
        missing.append("transformer_engine.pytorch.autocast / fp8_autocast")
    missing.extend(missing_arguments(te))
    return missing


def missing_arguments(te) -> list[str]:
    """`Class(keyword)` for each constructor keyword in REQUIRED_ARGUMENTS that `te` does not take."""
    import inspect

    missing = []
    for class_name, keywords in REQUIRED_ARGUMENTS:
        cls = getattr(te, class_name, None)
        if cls is None:
            continue  # reported by the attribute check
        parameters = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        missing.extend(f"{class_name}({k}=)" for k in keywords if k not in parameters and not takes_any)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at-least", default=MINIMUM, metavar="VERSION")
    parser.add_argument("--check-import", action="store_true")
    args = parser.parse_args(argv)
    version = installed_version()
    if version is None:
        print("transformer_engine: not installed")
        return 1
    if not at_least(version, args.at_least):
        print(f"transformer_engine {version}: older than {args.at_least}, which the trainer needs")
        return 1
    if args.check_import:
        import transformer_engine.pytorch  # noqa: F401  (TE's version-consistency check runs here)

        missing = missing_api()
        if missing:
            print(f"transformer_engine {version}: missing what the trainer calls: {', '.join(missing)}")
            return 1
    print(f"transformer_engine {version}: has what the trainer needs (>= {args.at_least})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
