"""The one precision switch: `--precision auto|bf16|fp32`, declared once (`PrecisionOptions`, mixed into the options
models of `uptrain`, `check`, `bench` and the calibrated conversions, hence also a recipe's `precision:` key) and
resolved once (`resolve_precision`).

- fp32: everything computes in float32.
- bf16: the forward passes compute in bfloat16 through autocast (the same code on CPU and CUDA: torch's CPU autocast,
  accelerate's `mixed_precision="bf16"`); weights, optimizer state and every statistic stay float32/float64.
- auto: bf16 where the device supports it (CUDA with bf16), fp32 elsewhere (the CPU, old GPUs).

`bench` measures inference, so there the precision is the dtype the models are loaded in (bf16: bfloat16 weights;
see surgery/bench/run.py); `--dtype`, where a command has it, names the weights' storage dtype and may not contradict
`--precision` (`check_dtype`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Literal

from pydantic import ValidationInfo, field_validator

from .options import CliModel, option, spelling

PRECISIONS = ("auto", "bf16", "fp32")
RESOLVED = ("bf16", "fp32")
DTYPE_OF = {"bf16": "bfloat16", "fp32": "float32"}  # surgery.dtypes' names
PRECISION_HELP = ("Compute precision: bf16 (autocast, float32 weights and statistics), fp32, or auto: bf16 where the "
                  "device supports it (CUDA with bf16), fp32 elsewhere.")


class PrecisionOptions(CliModel):
    """The `precision` field and its rule, mixed into a command's options model."""

    precision: Literal[PRECISIONS] = option("auto", "--precision", PRECISION_HELP)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, v, info: ValidationInfo):
        if v not in PRECISIONS:
            raise ValueError(f"{spelling(info, cls).flag('precision')} {v!r}: choose auto, bf16 or fp32")
        return v


def bf16_supported(device) -> bool:
    """Whether `device` computes in bf16 at speed: CUDA with bf16 support (the CPU emulates it: slower than fp32)."""
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    return dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_precision(precision: str, device) -> str:
    """"bf16" or "fp32": `precision` on `device` (a torch.device or its name; "auto": CUDA when present)."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: choose auto, bf16 or fp32")
    if precision != "auto":
        return precision
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "bf16" if bf16_supported(device) else "fp32"


def torch_dtype(resolved: str):
    """The torch dtype a resolved precision computes in."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[resolved]


def check_dtype(precision: str, dtype: str | None, flags: tuple[str, str] = ("--precision", "--dtype")) -> None:
    """Refuse (ValueError, one line) weights stored in `dtype` that cannot compute in `precision`: fp32 over 16-bit
    weights, bf16 over float16 weights."""
    if dtype is None or precision == "auto":
        return
    if (precision == "fp32" and dtype != "float32") or (precision == "bf16" and dtype == "float16"):
        raise ValueError(f"{flags[0]} {precision} contradicts {flags[1]} {dtype}: leave one out")


def weights_precision(precision: str, device, dtype: str) -> str:
    """The compute precision of a model whose weights are stored in `dtype` ("float32", "bfloat16", "float16"):
    `resolve_precision` over float32 weights; the weights' own precision over 16-bit ones (bf16 / fp16)."""
    check_dtype(precision, dtype)
    if dtype == "bfloat16":
        return "bf16"
    if dtype == "float16":
        return "fp16"
    return resolve_precision(precision, device)


def load_dtype(precision: str, dtype: str | None, device) -> str:
    """The dtype an inference run (`bench`) loads its models in: `dtype` when given (it may not contradict an explicit
    `precision`), else the dtype of `precision` resolved on `device` (auto: bfloat16 on CUDA with bf16, float32
    elsewhere)."""
    check_dtype(precision, dtype)
    return dtype or DTYPE_OF[resolve_precision(precision, device)]


# ---- autocast -------------------------------------------------------------------------------------------------
def autocast(resolved: str, device):
    """torch.autocast to bf16 on `device`'s type when `resolved` is "bf16"; otherwise a context that changes nothing."""
    import torch

    if resolved != "bf16":
        return contextlib.nullcontext()
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    return torch.autocast(dev.type, dtype=torch.bfloat16)


def full_precision(fn):
    """Run `fn` with autocast off (a hook that computes statistics inside a bf16 forward pass)."""
    import torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    return wrapped


# The calibration's precision while a calibrated conversion runs (`calibrating`): the layer-streamed forward passes
# (surgery/calibration/stream.py) read it, so that the converters need not pass it through every helper.
_CALIBRATION: contextvars.ContextVar[tuple[str, object] | None] = contextvars.ContextVar("calibration", default=None)


@contextlib.contextmanager
def calibrating(resolved: str, device):
    """Within the block, calibration forward passes (`calibration_autocast`) compute in `resolved` on `device`."""
    token = _CALIBRATION.set((resolved, device))
    try:
        yield
    finally:
        _CALIBRATION.reset(token)


def calibration_autocast():
    """The autocast of the calibrated conversion running now (none outside `calibrating`)."""
    active = _CALIBRATION.get()
    return autocast(*active) if active else contextlib.nullcontext()
