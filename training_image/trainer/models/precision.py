"""Precision as the recipe says, or a clear refusal at start: never a silent change of precision.

BF16 needs nothing beyond FSDP2's mixed-precision policy. FP8 runs the TE modules' GEMMs inside TE's
autocast with the recipe's scaling recipe:

    mxfp8   -> MXFP8BlockScaling      (Blackwell, SM 10.0+)
    current -> Float8CurrentScaling   (Hopper and Blackwell)
    delayed -> DelayedScaling         (Hopper and Blackwell)
    block   -> Float8BlockScaling     (Hopper and Blackwell, with a recent TE and CUDA)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch

from trainstack.errors import TrainstackError
from trainstack.recipes.schema import Precision

TE_RECIPE_CLASS = {
    "mxfp8": "MXFP8BlockScaling",
    "current": "Float8CurrentScaling",
    "delayed": "DelayedScaling",
    "block": "Float8BlockScaling",
}
# Minimum compute capability per recipe, used when TE cannot answer itself.
MIN_CAPABILITY = {"mxfp8": (10, 0), "current": (8, 9), "delayed": (8, 9), "block": (9, 0)}
# TE's own support checks (name in transformer_engine.pytorch.fp8 / .quantization).
TE_SUPPORT_CHECK = {
    "mxfp8": ("check_mxfp8_support", "is_mxfp8_available"),
    "current": ("check_fp8_support", "is_fp8_available"),
    "delayed": ("check_fp8_support", "is_fp8_available"),
    "block": ("check_fp8_block_scaling_support", "is_fp8_block_scaling_available"),
}


def _te_support(fp8_recipe: str) -> tuple[bool, str] | None:
    """(supported, reason) from Transformer Engine, or None when this TE version has no such check.

    TE moved and renamed these checks over versions (fp8.check_*_support() -> (ok, reason);
    is_*_available(return_reason=True)); try each, never guess from a failure."""
    check_name, available_name = TE_SUPPORT_CHECK[fp8_recipe]
    for module_name in (
        "transformer_engine.pytorch",
        "transformer_engine.pytorch.quantization",
        "transformer_engine.pytorch.fp8",
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, available_name):
            try:
                ok, reason = getattr(module, available_name)(return_reason=True)
            except TypeError:
                ok, reason = getattr(module, available_name)(), ""
            return bool(ok), str(reason)
        if hasattr(module, check_name):
            ok, reason = getattr(module, check_name)()
            return bool(ok), str(reason)
    return None


def fp8_recipe_supported(fp8_recipe: str) -> tuple[bool, str]:
    """Whether this process's CUDA device can run `fp8_recipe`, and why not."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    answer = _te_support(fp8_recipe)
    if answer is not None:
        return answer
    capability = torch.cuda.get_device_capability()
    need = MIN_CAPABILITY[fp8_recipe]
    if capability < need:
        have = f"{capability[0]}.{capability[1]}"
        return False, f"needs compute capability {need[0]}.{need[1]}+, this GPU is {have}"
    return True, ""


def check_precision(precision: Precision, device_type: str, backend_name: str) -> None:
    """Refuse at start a precision this process cannot run as written."""
    if precision.dtype != "fp8":
        return
    if device_type != "cuda":
        raise TrainstackError(
            f"precision.dtype: fp8 needs an NVIDIA GPU with Transformer Engine; this run is on {device_type} "
            "(use a bf16 recipe, or --set precision.dtype=bf16 precision.fp8_recipe=null, to run here)"
        )
    if backend_name != "transformer_engine":
        raise TrainstackError("precision.dtype: fp8 needs Transformer Engine, which does not import here")
    ok, reason = fp8_recipe_supported(precision.fp8_recipe)
    if not ok:
        gpu = torch.cuda.get_device_name()
        hint = ""
        if precision.fp8_recipe == "mxfp8":
            hint = " (MXFP8 needs Blackwell; use current or delayed on Hopper)"
        raise TrainstackError(
            f"precision.fp8_recipe: {precision.fp8_recipe} cannot run on {gpu}: {reason}{hint}"
        )


def te_recipe(fp8_recipe: str) -> Any:
    from transformer_engine.common import recipe as te_recipes

    return getattr(te_recipes, TE_RECIPE_CLASS[fp8_recipe])()


def autocast_factory(precision: Precision) -> Callable[[], contextlib.AbstractContextManager]:
    """A no-argument context-manager factory wrapping each micro-step's forward pass."""
    if precision.dtype != "fp8":
        return contextlib.nullcontext
    import transformer_engine.pytorch as te

    scaling = te_recipe(precision.fp8_recipe)
    if hasattr(te, "autocast"):  # TE 2.9 renamed fp8_autocast to autocast (2.8 has only the old name)
        return lambda: te.autocast(enabled=True, recipe=scaling)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=scaling)
