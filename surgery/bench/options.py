"""`surgery bench`'s options (BenchOptions) and the refusals checked before anything is loaded: engines, lists,
flash attention, torch.compile, and whose code each model's trust flag trusts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SurgeryError

ENGINES = ("transformers", "llama.cpp", "vllm")
# the package each engine needs (llama.cpp: either of its bindings, surgery/bench/llama_cpp_bindings.py)
ENGINE_PACKAGES = {"vllm": ("vllm", "vllm")}
# llama.cpp's flash attention (--flash-attn). llama-cpp-python 0.3.36's `Llama` takes a bool (ENABLED or DISABLED:
# llama.cpp's own AUTO is not reachable through it), so the choice is on/off for both bindings; the default is on,
# what llama.cpp's AUTO (its CLI's and its context's default) resolves to on CPU and on GPUs whose backend has the
# kernel.
FLASH_ATTN = ("on", "off")
FLASH_ATTN_DEFAULT = "on"


@dataclass
class BenchOptions:
    source: str
    converted: str
    batches: list[int] = field(default_factory=lambda: [1])
    contexts: list[int] = field(default_factory=lambda: [512])
    new: int = 16
    dtype: str | None = None  # the models' dtype; None: the dtype of --precision (surgery.precision.load_dtype)
    precision: str = "auto"  # bf16: bfloat16 weights, fp32: float32; auto: bf16 on CUDA with bf16, else fp32
    device: str = "auto"
    threads: int | None = None
    rounds: int = 3
    engine: str = "transformers"
    trust_remote_code: bool = False  # run the code CONVERTED ships (and nothing else)
    trust_source_code: bool = False  # run the code SOURCE ships
    seed: int = 0
    replicate_prefill: bool = False  # batch > 1: prefill one row, copy its cache to the batch (decode only)
    compile: str | None = None  # torch.compile backend for both models (transformers engine): "inductor", "eager" ...
    flash_attn: str | None = None  # llama.cpp engine: "on" / "off"; None: FLASH_ATTN_DEFAULT (other engines: none)


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise SurgeryError(f"{name} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SurgeryError(f"{name} takes comma-separated positive integers, got {text!r}")
    return values


def require_engine_dtype(dtype: str | None, engine: str) -> None:
    """`--dtype` chooses the models' torch dtype; llama.cpp runs a GGUF's weights as stored (one line, exit 2)."""
    if dtype is not None and engine == "llama.cpp":
        raise SurgeryError("--dtype: a GGUF file's weights run as stored with --engine llama.cpp (choose them when "
                           "writing it: surgery export CHECKPOINT --gguf FILE --dtype f32|f16|bf16|q8_0)")


def require_engine(engine: str) -> None:
    """Refuse (one line, exit 2) an engine that is not known or not installed."""
    if engine not in ENGINES:
        raise SurgeryError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    if engine == "llama.cpp":
        from .llama_cpp_bindings import pick_binding

        pick_binding()
    if engine in ENGINE_PACKAGES:
        module, package = ENGINE_PACKAGES[engine]
        import importlib.util

        if importlib.util.find_spec(module) is None:
            raise SurgeryError(f"--engine {engine} needs the {package} package, which is not installed "
                               f"(pip install {package})")


def resolve_flash_attn(choice: str | None, engine: str) -> str | None:
    """The flash-attention setting a run measures: `choice` or the default for llama.cpp; None for the other
    engines, which refuse an explicit choice (one line) rather than ignore it: transformers runs sdpa here, and vLLM
    picks its own attention backend (an MLA model gets its MLA kernels), so a switch there would measure nothing."""
    if engine != "llama.cpp":
        if choice is not None:
            raise SurgeryError(f"--flash-attn works with --engine llama.cpp only (--engine {engine} picks its own "
                               f"attention: transformers runs sdpa, vllm its backend for the model)")
        return None
    if choice is None:
        return FLASH_ATTN_DEFAULT
    if choice not in FLASH_ATTN:
        raise SurgeryError(f"--flash-attn {choice}: choose {' or '.join(FLASH_ATTN)}")
    return choice


def require_compile(backend: str | None, engine: str, device: torch.device) -> None:
    """Refuse (one line) a --compile that cannot run: other engines, unknown backends, no C++ compiler on CPU."""
    if not backend:
        return
    if engine != "transformers":
        raise SurgeryError("--compile works with the transformers engine only")
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise SurgeryError(f"--compile {backend}: not a torch.compile backend (choose from "
                           f"{', '.join(torch._dynamo.list_backends())}, eager)")
    if backend == "inductor" and device.type == "cpu":
        import shutil

        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None:
            raise SurgeryError(f"--compile inductor on CPU needs a C++ compiler ({compiler} is not on PATH)")


# The flag that trusts each model's code: --trust-remote-code names CONVERTED only, as in `check`.
TRUST_FLAGS = {"source": "--trust-source-code", "converted": "--trust-remote-code"}


def trusted_roles(opts: BenchOptions) -> dict[str, bool]:
    return {"source": opts.trust_source_code, "converted": opts.trust_remote_code}


def role_trust(folder: Path, role: str, trusted: dict[str, bool], spec: str) -> bool:
    """`trust_remote_code` for the `role` model: its own flag only, or the toolkit's own code (surgery/trust.py)."""
    from ..trust import resolve_trust

    return resolve_trust(folder, trusted[role], TRUST_FLAGS[role], what=f"the {role} {spec}")
