"""`surgery bench`: measured speed and memory of a converted checkpoint against its source, in one run.

Both models are loaded once into this process, warmed up, and then measured in alternating rounds (source first in
even rounds, converted first in odd ones) for every batch x context, so that whatever else runs on the machine hits
both alike. Each measurement: a prefill of `batch x context` random tokens (the same for both models) that fills
a fresh KV cache, then `new` single-token decode steps on that cache. Recorded per round: prefill seconds, decode
seconds per step, the bytes of the KV cache after the prefill, and the peak memory of the prefill + decode
(CUDA: torch.cuda.max_memory_allocated above what was allocated before; CPU: the kernel's peak RSS (VmHWM, reset
through /proc/self/clear_refs) above the RSS before — Linux only, None elsewhere). The report keeps every raw
round; medians, min/max and the converted/source ratios of the medians are computed from them.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .checkpoint.atomic import check_output_file, temp_prefix
from .dtypes import DTYPE_NAMES
from .errors import SurgeryError
from .precision import load_dtype
from .runtime import cache_keyword, returned_cache
from .units import human_bytes

ENGINES = ("transformers", "llama.cpp", "vllm")
ENGINE_PACKAGES = {"llama.cpp": ("llama_cpp", "llama-cpp-python"), "vllm": ("vllm", "vllm")}
# llama.cpp's flash attention (--flash-attn). llama-cpp-python 0.3.36's `Llama` takes a bool (ENABLED or DISABLED:
# llama.cpp's own AUTO is not reachable through it), so the choice is on/off; the default is on, what llama.cpp's
# AUTO (its CLI's and its context's default) resolves to on CPU and on GPUs whose backend has the kernel.
FLASH_ATTN = ("on", "off")
FLASH_ATTN_DEFAULT = "on"
METRICS = ("prefill_s", "prefill_tokens_per_s", "decode_step_s", "decode_tokens_per_s", "kv_cache_bytes",
           "peak_memory_bytes")
# For the table: which way is better (True: higher).
HIGHER_IS_BETTER = {"prefill_tokens_per_s": True, "decode_tokens_per_s": True, "prefill_s": False,
                    "decode_step_s": False, "kv_cache_bytes": False, "peak_memory_bytes": False}


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


def require_engine(engine: str) -> None:
    """Refuse (one line, exit 2) an engine that is not known or not installed."""
    if engine not in ENGINES:
        raise SurgeryError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
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


# --- memory -----------------------------------------------------------------------------------------------------
def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device`: CUDA's free memory, or the host's MemAvailable (Linux)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def least_bytes(config, batch: int, context: int, new: int, dtype: str) -> int:
    """A lower bound of what one batch x context measurement allocates: the token ids, one hidden state of the
    prompt and, where the config tells its shape, the KV cache. Anything above this would still not fit."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (hidden // heads if heads else 0))
    tokens = batch * (context + new)
    return tokens * 8 + batch * context * hidden * itemsize + tokens * layers * 2 * kv_heads * head_dim * itemsize


def check_fits(opts: "BenchOptions", handle: dict, role: str, device: torch.device) -> None:
    """Refuse (one line) a --batch x --context that cannot fit in the memory left, before anything is allocated."""
    model = handle.get("model")
    free = available_bytes(device)
    if free is None or not hasattr(model, "config"):
        return
    batch, context = max(opts.batches), max(opts.contexts)
    need = least_bytes(model.config, batch, context, opts.new, opts.dtype)
    if need > free:
        raise SurgeryError(f"--batch {batch} x --context {context} needs at least {need / 2**30:.1f} GiB for the "
                           f"{role} model's tokens, hidden states and KV cache, more than the {free / 2**30:.1f} GiB "
                           f"free on {device}: lower --batch or --context")


def _status_bytes(key: str) -> int | None:
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class PeakMemory:
    """Peak memory above the starting point of a `with` block, on CUDA or (Linux) CPU; `bytes` is None when the
    platform cannot tell."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
                self._start = _status_bytes("VmRSS")
            except OSError:
                self._start = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self._start is not None:
            peak = _status_bytes("VmHWM")
            self.bytes = None if peak is None else max(0, peak - self._start)
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SyncedTimer:
    """Seconds of a `with` block on `device`, read between two synchronizations: what was queued before it is done
    before the clock starts, and what it queued is done before the clock stops (CUDA runs asynchronously)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, None

    def __enter__(self):
        _sync(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync(self.device)
        self.seconds = time.perf_counter() - self._start
        return False


# --- engines ----------------------------------------------------------------------------------------------------
def cache_bytes(cache) -> int:
    """Bytes of the key/value tensors a transformers cache holds."""
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is None:  # an EncoderDecoderCache
        inner = getattr(cache, "self_attention_cache", None)
        layers = getattr(inner, "layers", [])
    for layer in layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def kv_bytes_from_config(config: dict, tokens: int, element_size: int, engine: str = "vllm",
                         record: dict | None = None) -> int:
    """KV-cache bytes for `tokens` tokens by the config (engines that do not expose their cache tensors): what the
    kind that wrote the checkpoint (its config, its surgery.json `record`) says `engine` caches (surgery/kinds)."""
    from .arch import attention_shape
    from .kinds import AttentionShape, kv_cache_values

    text = config.get("text_config") or config
    s = attention_shape(text)
    shape = AttentionShape(s["layers"], s["heads"], s["kv_heads"], s["head_dim"], s["hidden"])
    return kv_cache_values(shape, text, record, context=tokens)[engine] * tokens * element_size


def plain_kv_values(layers: int, kv_heads: int, head_dim: int) -> int:
    """Values llama.cpp caches per token for a GGUF's attention (read from its metadata: no kind to ask)."""
    from .kinds import AttentionShape, plain_kv_cache_values

    return plain_kv_cache_values(AttentionShape(layers, 0, kv_heads, head_dim, 0))["llama.cpp"]


def gguf_kv_values(meta: dict) -> int:
    """Values llama.cpp caches per token for the model a GGUF's metadata describes. A latent-attention file (one
    with `ARCH.attention.kv_lora_rank`, DeepSeek's layout) caches one K row per layer, the latent and the rope key
    (`key_length` = kv_lora_rank + rope dims), and no V: llama.cpp absorbs the up-projections and logs
    "V (f16): 0.00 MiB". Every other file caches K and V per KV head."""
    arch = meta.get("general.architecture", "llama")
    layers = int(meta[f"{arch}.block_count"])
    heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
    if f"{arch}.attention.kv_lora_rank" in meta:
        return layers * head_dim
    return plain_kv_values(layers, int(meta.get(f"{arch}.attention.head_count_kv", heads)), head_dim)


class TransformersEngine:
    """transformers' model classes: sdpa for standard models, the checkpoint's own code for converted kinds."""

    name = "transformers"

    def __init__(self, device: torch.device, dtype: str, trusted: dict[str, bool], compile: str | None = None):
        from transformers.utils import logging as hf_logging

        self.device, self.dtype, self.trusted, self.compile = device, dtype, trusted, compile
        hf_logging.disable_progress_bar()

    def preflight(self, spec: str, role: str) -> bool:
        """Refuse before anything is loaded; the `trust_remote_code` to load `spec` (the `role` model) with."""
        from .checkpoint.source import resolve_source

        return role_trust(resolve_source(spec).folder, role, self.trusted, spec)

    def load(self, spec: str, role: str):
        from .runtime import load_model
        from .checkpoint.source import resolve_source

        from .kinds import check_checkpoint

        trust = self.preflight(spec, role)
        source = resolve_source(spec)
        check_checkpoint(source.folder, source.config)
        custom = bool(source.config.get("auto_map"))
        model = load_model(source, self.device, self.dtype, trust_remote_code=trust,
                           attn_implementation=None if custom else "sdpa")
        if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (model.config.architectures or [])):
            raise SurgeryError(f"{spec} is not a causal language model: bench measures prefill and decode")
        if self.compile:  # both models alike; dynamic shapes, so a new cache length is not a new graph
            model.forward = torch.compile(model.forward, backend=self.compile, dynamic=True)
        return {"model": model, "spec": spec, "folder": str(source.folder), "custom_code": custom,
                "compiled": self.compile,
                "model_type": source.config.get("model_type"),
                "attention": getattr(model.config, "_attn_implementation", None),
                "vocab_size": int(model.config.get_text_config().vocab_size),
                "max_positions": _max_positions(model.config)}

    @torch.no_grad()
    def measure(self, handle: dict, ids: torch.Tensor, next_ids: torch.Tensor, replicate: bool = False) -> dict:
        model, device = handle["model"], self.device
        ids, next_ids = ids.to(device), next_ids.to(device)
        batch = ids.shape[0]
        steps = []
        with PeakMemory(device) as peak:
            with SyncedTimer(device) as prefill:
                out = model(input_ids=ids[:1] if replicate else ids, use_cache=True, logits_to_keep=1)
            cache = returned_cache(out)
            if replicate and batch > 1:  # the same prompt in every row: decode costs do not depend on the tokens
                cache.batch_repeat_interleave(batch)  # (not timed: the first step's timer waits for it to finish)
            kv = cache_bytes(cache)
            del out
            keyword = cache_keyword(model)
            for j in range(next_ids.shape[1]):
                with SyncedTimer(device) as step:
                    model(input_ids=next_ids[:, j : j + 1], use_cache=True, **{keyword: cache})
                steps.append(step.seconds)
            del cache
        return {"prefill_s": prefill.seconds, "decode_steps_s": steps, "kv_cache_bytes": kv,
                "peak_memory_bytes": peak.bytes}

    def close(self, handle: dict) -> None:
        handle.pop("model", None)


class LlamaCppEngine:
    """llama-cpp-python on a GGUF file (SOURCE/CONVERTED given as .gguf files, e.g. written by llama.cpp's
    convert_hf_to_gguf.py). Batch 1 only; the KV cache is counted from the GGUF's metadata (f16 cache). Flash
    attention on or off for both files alike (`flash_attn`): on CPU it speeds an MLA file's decoding up and an MQA
    file's down at long context (BENCHMARKS.md), so a report says which path it measured."""

    name = "llama.cpp"

    def __init__(self, device: torch.device, dtype: str, threads: int | None, max_tokens: int, flash_attn: bool):
        self.threads, self.max_tokens, self.flash_attn = threads, max_tokens, flash_attn
        self.gpu_layers = -1 if device.type == "cuda" else 0

    def load(self, spec: str, role: str):
        import llama_cpp

        path = Path(spec)
        if path.suffix != ".gguf" or not path.is_file():
            raise SurgeryError(f"--engine llama.cpp takes .gguf files (convert a folder with llama.cpp's "
                               f"convert_hf_to_gguf.py first), got {spec}")
        threads = self.threads or os.cpu_count()  # prefill (batch) threads too: llama.cpp's default is every core
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=self.max_tokens, n_batch=512, n_ubatch=512,
                              n_threads=threads, n_threads_batch=threads, n_gpu_layers=self.gpu_layers,
                              flash_attn=self.flash_attn, logits_all=False, verbose=False)
        meta = llm.metadata
        # what the context was built with (read back from it, not from the option)
        flash = llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        return {"model": llm, "spec": spec, "folder": str(path), "custom_code": False,
                "model_type": meta.get("general.architecture", "llama"),
                "attention": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, flash attention "
                             f"{'on' if flash else 'off'})",
                "flash_attn": flash,
                "vocab_size": int(llm.n_vocab()), "max_positions": self.max_tokens,
                "kv_per_token": gguf_kv_values(meta) * 2}

    def measure(self, handle: dict, ids: torch.Tensor, next_ids: torch.Tensor, replicate: bool = False) -> dict:
        if ids.shape[0] != 1:
            raise SurgeryError("--engine llama.cpp measures batch 1 only (use --batch 1)")
        llm = handle["model"]
        llm.reset()
        steps = []
        with PeakMemory(torch.device("cpu")) as peak:
            start = time.perf_counter()
            llm.eval(ids[0].tolist())
            prefill = time.perf_counter() - start
            for token in next_ids[0].tolist():
                start = time.perf_counter()
                llm.eval([token])
                steps.append(time.perf_counter() - start)
        return {"prefill_s": prefill, "decode_steps_s": steps, "kv_cache_bytes": handle["kv_per_token"] * ids.shape[1],
                "peak_memory_bytes": peak.bytes}

    def close(self, handle: dict) -> None:
        handle.pop("model", None)


class VllmEngine:
    """vLLM's offline LLM: prefill = a generation of one token; decode step = (time of `new` tokens - that) /
    (new - 1). The KV cache is counted from the config (vLLM preallocates its blocks)."""

    name = "vllm"

    def __init__(self, device: torch.device, dtype: str, trusted: dict[str, bool], max_tokens: int):
        self.dtype, self.trusted, self.max_tokens = dtype, trusted, max_tokens

    def load(self, spec: str, role: str):
        from vllm import LLM

        from .checkpoint.record import read_record
        from .checkpoint.source import resolve_source

        source = resolve_source(spec)
        custom = bool(source.config.get("auto_map"))
        trust = role_trust(source.folder, role, self.trusted, spec)
        llm = LLM(model=str(source.folder), dtype=self.dtype, trust_remote_code=trust, max_model_len=self.max_tokens,
                  gpu_memory_utilization=0.4, enforce_eager=False)
        return {"model": llm, "spec": spec, "folder": str(source.folder), "custom_code": custom,
                "model_type": source.config.get("model_type"), "attention": "vllm",
                "vocab_size": int(source.config.get("vocab_size")), "max_positions": self.max_tokens,
                "config": source.config, "record": read_record(source.folder)}

    def measure(self, handle: dict, ids: torch.Tensor, next_ids: torch.Tensor, replicate: bool = False) -> dict:
        from vllm import SamplingParams

        llm, new = handle["model"], next_ids.shape[1]
        prompts = [{"prompt_token_ids": row.tolist()} for row in ids]

        def run(tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        prefill = run(1)
        total = run(new + 1)
        step = max(total - prefill, 0.0) / max(new, 1)
        size = torch.finfo(getattr(torch, self.dtype)).bits // 8
        return {"prefill_s": prefill, "decode_steps_s": [step] * new,
                "kv_cache_bytes": kv_bytes_from_config(handle["config"], ids.numel(), size, "vllm", handle["record"]), "peak_memory_bytes": None}

    def close(self, handle: dict) -> None:
        handle.pop("model", None)


def _max_positions(config) -> int | None:
    text = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions"):
        if getattr(text, key, None):
            return int(getattr(text, key))
    return None


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
    from .trust import resolve_trust

    return resolve_trust(folder, trusted[role], TRUST_FLAGS[role], what=f"the {role} {spec}")


def make_engine(opts: BenchOptions, device: torch.device):
    require_engine(opts.engine)
    require_compile(opts.compile, opts.engine, device)
    longest = max(opts.contexts) + opts.new
    if opts.engine == "llama.cpp":
        return LlamaCppEngine(device, opts.dtype, opts.threads, longest,
                              flash_attn=resolve_flash_attn(opts.flash_attn, opts.engine) == "on")
    if opts.engine == "vllm":
        if device.type != "cuda":
            raise SurgeryError("--engine vllm needs a CUDA device")
        return VllmEngine(device, opts.dtype, trusted_roles(opts), longest)
    return TransformersEngine(device, opts.dtype, trusted_roles(opts), opts.compile)


# --- statistics -------------------------------------------------------------------------------------------------
def derived(raw: dict, batch: int, context: int, prefill_batch: int | None = None) -> dict:
    """The metrics of one measured round (`prefill_batch`: the rows the prefill ran on, default `batch`)."""
    steps = raw["decode_steps_s"]
    step = statistics.median(steps) if steps else None
    decode_total = sum(steps)
    return {
        "prefill_s": raw["prefill_s"],
        "prefill_tokens_per_s": (prefill_batch or batch) * context / raw["prefill_s"],
        "decode_step_s": step,
        "decode_tokens_per_s": batch * len(steps) / decode_total if decode_total > 0 else None,
        "kv_cache_bytes": raw["kv_cache_bytes"],
        "peak_memory_bytes": raw["peak_memory_bytes"],
    }


def summarize(rounds: list[dict]) -> dict:
    """Per metric: median, min, max and spread ((max - min) / median) over the rounds."""
    out = {}
    for key in METRICS:
        values = [r[key] for r in rounds if r.get(key) is not None]
        if not values:
            out[key] = {"median": None, "min": None, "max": None, "spread": None}
            continue
        med = statistics.median(values)
        out[key] = {"median": med, "min": min(values), "max": max(values),
                    "spread": (max(values) - min(values)) / med if med else 0.0}
    return out


def ratios(source: dict, converted: dict) -> dict:
    """converted / source of each metric's median (None where either is missing or zero)."""
    out = {}
    for key in METRICS:
        a, b = source[key]["median"], converted[key]["median"]
        out[key] = b / a if a and b is not None else None
    return out


# --- the run ----------------------------------------------------------------------------------------------------
def machine_info(device: torch.device, threads: int) -> dict:
    import transformers

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device), "threads": threads}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda s: None,
              partial: Callable[[dict], None] | None = None) -> dict:
    from .runtime import pick_device

    if opts.rounds < 1 or opts.new < 1:
        raise SurgeryError("--rounds and --new must be at least 1")
    if opts.dtype is not None and opts.dtype not in DTYPE_NAMES:
        raise SurgeryError(f"--dtype {opts.dtype}: choose float32, bfloat16 or float16")
    try:
        load_dtype(opts.precision, opts.dtype, "cpu")  # a contradiction is refused before a device is touched
    except ValueError as e:
        raise SurgeryError(str(e)) from None
    if opts.replicate_prefill and opts.engine != "transformers":
        raise SurgeryError("--replicate-prefill works with the transformers engine only")
    if opts.threads is not None and opts.threads < 1:
        raise SurgeryError(f"--threads must be at least 1, got {opts.threads}")
    resolve_flash_attn(opts.flash_attn, opts.engine)  # before a device or a model is touched
    device = pick_device(opts.device)
    opts = dataclasses.replace(opts, dtype=load_dtype(opts.precision, opts.dtype, device))
    engine = make_engine(opts, device)
    before_threads = torch.get_num_threads()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    try:
        return _run(opts, engine, device, log, partial)
    finally:
        torch.set_num_threads(before_threads)


def _run(opts: BenchOptions, engine, device: torch.device, log, partial=None) -> dict:
    started = time.time()
    start_info = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "machine": machine_info(device, torch.get_num_threads())}  # load average at the start
    for role, spec in (("source", opts.source), ("converted", opts.converted)):
        if hasattr(engine, "preflight"):
            engine.preflight(spec, role)
    handles = {}
    for role, spec in (("source", opts.source), ("converted", opts.converted)):
        with SyncedTimer(device) as load:
            handles[role] = engine.load(spec, role)
        handles[role]["load_s"] = load.seconds
    vocab = min(h["vocab_size"] for h in handles.values())
    for role, h in handles.items():
        if h["max_positions"] and max(opts.contexts) + opts.new > h["max_positions"]:
            raise SurgeryError(f"--context {max(opts.contexts)} + --new {opts.new} exceeds the {role} model's "
                               f"{h['max_positions']} positions")
    for role, h in handles.items():
        check_fits(opts, h, role, device)
    gen = torch.Generator().manual_seed(opts.seed)
    warm = torch.randint(0, vocab, (1, min(32, min(opts.contexts))), generator=gen)
    for h in handles.values():  # warm-up: first calls allocate and pick kernels
        engine.measure(h, warm, warm[:, :2])
    results = []
    for batch in opts.batches:
        for context in opts.contexts:
            ids = torch.randint(0, vocab, (batch, context), generator=gen)
            next_ids = torch.randint(0, vocab, (batch, opts.new), generator=gen)
            rounds = {"source": [], "converted": []}
            replicate = opts.replicate_prefill and batch > 1
            prefill_batch = 1 if replicate else batch
            compile_s = {}
            if opts.compile:  # compiled graphs are made for the first calls of a shape: not measured
                for role, h in handles.items():
                    with SyncedTimer(device) as warmup:
                        engine.measure(h, ids, next_ids[:, :2], replicate=replicate)
                    compile_s[role] = round(warmup.seconds, 2)
                log(f"batch {batch} context {context}: compiled in {compile_s['source']:.0f} s (source) and "
                    f"{compile_s['converted']:.0f} s (converted)")
            for r in range(opts.rounds):
                order = ("source", "converted") if r % 2 == 0 else ("converted", "source")
                for role in order:
                    raw = engine.measure(handles[role], ids, next_ids, replicate=replicate)
                    rounds[role].append({"round": r, **raw, **derived(raw, batch, context, prefill_batch)})
                log(f"batch {batch} context {context} round {r + 1}/{opts.rounds}: decode "
                    f"{rounds['source'][-1]['decode_tokens_per_s']:.1f} vs "
                    f"{rounds['converted'][-1]['decode_tokens_per_s']:.1f} tokens/s")
            summary = {role: summarize(rs) for role, rs in rounds.items()}
            results.append({"batch": batch, "context": context, "prefill_batch": prefill_batch, **summary,
                            "ratio": ratios(summary["source"], summary["converted"]), "rounds": rounds,
                            **({"compile_warmup_s": compile_s} if opts.compile else {})})
            if partial is not None:  # the report so far, after every batch x context (long runs)
                partial(_report(opts, engine, handles, results, started, start_info))
    report = _report(opts, engine, handles, results, started, start_info)
    for h in handles.values():
        engine.close(h)
    return report


def _report(opts: BenchOptions, engine, handles: dict, results: list, started: float, start_info: dict) -> dict:
    models = {role: {k: v for k, v in h.items() if k not in ("model", "config")} for role, h in handles.items()}
    return {
        "command": "surgery bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
        "date": start_info["date"],
        "seconds": time.time() - started,
        "engine": engine.name,
        "dtype": opts.dtype,
        "precision": opts.precision,
        "new_tokens": opts.new,
        "rounds": opts.rounds,
        "replicate_prefill": opts.replicate_prefill,
        "compile": opts.compile,
        "flash_attn": resolve_flash_attn(opts.flash_attn, opts.engine),  # "on" / "off" (llama.cpp), else None
        "batches": opts.batches,
        "contexts": opts.contexts,
        "machine": start_info["machine"],
        "models": models,
        "results": results,
    }


# --- output -----------------------------------------------------------------------------------------------------
def _cell(key: str, stats: dict) -> str:
    med = stats["median"]
    if med is None:
        return "-"
    if key.endswith("bytes"):
        return human_bytes(med)
    spread = f" ±{50 * stats['spread']:.0f}%" if stats["spread"] else ""
    if key == "decode_step_s":
        return f"{1000 * med:.1f} ms{spread}"
    return f"{med:,.1f}{spread}"


TABLE_COLUMNS = (("prefill_tokens_per_s", "prefill tok/s"), ("decode_tokens_per_s", "decode tok/s"),
                 ("decode_step_s", "decode step"), ("kv_cache_bytes", "KV cache"), ("peak_memory_bytes", "peak mem"))


def print_bench(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = report["machine"]
    title = (f"{report['models']['converted']['spec']} vs {report['models']['source']['spec']} — {report['engine']}, "
             f"{report['dtype']}, {m['device']}, {m['threads']} threads, {report['rounds']} rounds, "
             f"{report['new_tokens']} new tokens"
             + (f", flash attention {report['flash_attn']}" if report.get("flash_attn") else ""))
    table = Table(title=title, caption="median (± half the min-max spread); ratio = converted / source "
                  "(tokens/s: > 1 is faster; time and bytes: < 1 is better)")
    table.add_column("batch", justify="right")
    table.add_column("context", justify="right")
    table.add_column("model")
    for _, name in TABLE_COLUMNS:
        table.add_column(name, justify="right")
    for row in report["results"]:
        for role in ("source", "converted"):
            table.add_row(str(row["batch"]), str(row["context"]), role,
                          *[_cell(key, row[role][key]) for key, _ in TABLE_COLUMNS])
        table.add_row("", "", "[bold]ratio[/bold]",
                      *[f"[bold]{row['ratio'][key]:.3f}x[/bold]" if row["ratio"][key] is not None else "-"
                        for key, _ in TABLE_COLUMNS], end_section=True)
    Console().print(table)


def markdown_table(report: dict) -> list[str]:
    """The ratio table as Markdown (for the model card and BENCHMARKS.md)."""
    lines = ["| batch | context | prefill tok/s (src → conv) | decode tok/s (src → conv) | decode speed-up "
             "| KV cache | peak memory |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        s, c, r = row["source"], row["converted"], row["ratio"]

        def pair(key, fmt=",.0f"):
            a, b = s[key]["median"], c[key]["median"]
            return "-" if a is None or b is None else f"{a:{fmt}} → {b:{fmt}}"

        def ratio(key):
            return "-" if r[key] is None else f"{r[key]:.2f}x"

        lines.append(f"| {row['batch']} | {row['context']} | {pair('prefill_tokens_per_s')} "
                     f"({ratio('prefill_tokens_per_s')}) | {pair('decode_tokens_per_s', ',.1f')} | "
                     f"{ratio('decode_tokens_per_s')} | {ratio('kv_cache_bytes')} | {ratio('peak_memory_bytes')} |")
    return lines


def plot_bench(report: dict, path: Path) -> None:
    """Tokens/s against context, one panel for prefill and one for decode, a line per model and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "prefill_tokens_per_s", "prefill"), (axes[1], "decode_tokens_per_s", "decode")):
        for batch in report["batches"]:
            rows = sorted((r for r in report["results"] if r["batch"] == batch), key=lambda r: r["context"])
            for role, style in (("source", "o-"), ("converted", "s--")):
                xs = [r["context"] for r in rows if r[role][key]["median"] is not None]
                ys = [r[role][key]["median"] for r in rows if r[role][key]["median"] is not None]
                ax.plot(xs, ys, style, label=f"{role}, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("tokens / s")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['models']['converted']['spec']} vs {report['models']['source']['spec']} "
                 f"({report['engine']}, {report['machine']['device']})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "tmp"), suffix=path.suffix, dir=path.absolute().parent)
    os.close(fd)
    try:  # written beside, then renamed: never half a picture
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        plt.close(fig)


def check_plot_path(path: Path | None) -> None:
    """--plot can be written, in a format matplotlib knows, checked before the measurements."""
    if path is None:
        return
    check_output_file(path, "--plot")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise SurgeryError(f"--plot {path}: name a picture file ({', '.join('.' + f for f in sorted(formats))})")
