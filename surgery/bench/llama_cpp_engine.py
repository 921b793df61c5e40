"""The llama.cpp engine (GGUF files through llama-cpp-python or llama-cpp-py-sync), and the KV cache it allocates,
counted from a GGUF's metadata and, where the binding shows llama.cpp's log, as llama.cpp reports it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..errors import SurgeryError
from .measure import PeakMemory

def plain_kv_values(layers: int, kv_heads: int, head_dim: int) -> int:
    """Values llama.cpp caches per token for a GGUF's attention (read from its metadata: no kind to ask)."""
    from ..kinds import AttentionShape, plain_kv_cache_values

    return plain_kv_cache_values(AttentionShape(layers, 0, kv_heads, head_dim, 0))["llama.cpp"]


def gguf_kv_values(meta: dict, context: int | None = None) -> int:
    """Values llama.cpp caches per token for the model a GGUF's metadata describes, averaged over `context` tokens
    (None: as if every layer held them all). A latent-attention file (one with `ARCH.attention.kv_lora_rank`,
    DeepSeek's layout) caches one K row per layer, the latent and the rope key (`key_length` = kv_lora_rank + rope
    dims), and no V: llama.cpp absorbs the up-projections and logs "V (f16): 0.00 MiB". Every other file caches K
    and V per KV head; a layer its `ARCH.attention.sliding_window_pattern` marks (granite_swa, `surgery export`'s swa
    output) holds the window only; a per-layer `head_count_kv` list (granitehybrid, `surgery export`'s hybrid output)
    counts each layer's own heads, 0 for a mixer layer (its state is `gguf_state_bytes`)."""
    arch = meta.get("general.architecture", "llama")
    layers = int(meta[f"{arch}.block_count"])
    heads = _per_layer(meta[f"{arch}.attention.head_count"], layers)
    head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // max(heads)))
    if f"{arch}.attention.kv_lora_rank" in meta:
        return layers * head_dim
    kv_heads = _per_layer(meta.get(f"{arch}.attention.head_count_kv", heads), layers)
    per_layer = [plain_kv_values(1, kv, head_dim) if kv else 0 for kv in kv_heads]
    pattern, window = meta.get(f"{arch}.attention.sliding_window_pattern"), meta.get(f"{arch}.attention.sliding_window")
    if not context or not window or not isinstance(pattern, list):
        return sum(per_layer)
    share = min(context, int(window)) / context
    return round(sum(v * (share if p else 1) for v, p in zip(per_layer, pattern)))


def gguf_state_bytes(meta: dict) -> int:
    """Bytes of the fixed recurrent state llama.cpp keeps per sequence for a GGUF's Mamba-2 mixer layers (f32, as it
    allocates them): the convolution's last `conv_kernel - 1` inputs of x, B and C, and the SSM state, per mixer
    layer (the layers a per-layer `head_count_kv` list gives no K/V head). 0 for a file without mixers."""
    arch = meta.get("general.architecture", "llama")
    if f"{arch}.ssm.inner_size" not in meta:
        return 0
    layers = int(meta[f"{arch}.block_count"])
    mixers = sum(1 for kv in _per_layer(meta.get(f"{arch}.attention.head_count_kv", 0), layers) if not kv)
    inner, state = int(meta[f"{arch}.ssm.inner_size"]), int(meta[f"{arch}.ssm.state_size"])
    groups, kernel = int(meta.get(f"{arch}.ssm.group_count", 1)), int(meta[f"{arch}.ssm.conv_kernel"])
    per_layer = (kernel - 1) * (inner + 2 * groups * state) + state * inner
    return mixers * per_layer * 4


def gguf_file_type(meta: dict) -> str:
    """The weights' type a GGUF declares (`general.file_type`): f32, f16, bf16, q8_0, ..."""
    from gguf import LlamaFileType

    code = meta.get("general.file_type")
    if code is None:
        return "unknown"
    try:
        name = LlamaFileType(int(code)).name
    except ValueError:
        return f"file type {code}"
    return name.removeprefix("ALL_").removeprefix("MOSTLY_").lower()


def _per_layer(value, layers: int) -> list[int]:
    """A GGUF count that is either one number for every layer or a list with one per layer."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


def gguf_metadata(path: Path) -> dict:
    """A GGUF file's metadata read with gguf-py: {key: value}, arrays as lists (the sliding-window pattern)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return {k: f.contents() for k, f in fields.items() if not k.startswith("tokenizer.ggml.")}


class LlamaCppEngine:
    """llama.cpp on a GGUF file (SOURCE/CONVERTED given as .gguf files, written by `surgery export --gguf`), through
    whichever binding is installed and loads (surgery/bench/llama_cpp_bindings.py: llama-cpp-python, or the prebuilt
    llama-cpp-py-sync). Batch 1 only; the KV cache counted from the GGUF's metadata (f16 cache), and, where the
    binding shows llama.cpp's log (llama-cpp-py-sync), the cache llama.cpp reports it allocated. Flash attention on
    or off for both files alike (`flash_attn`): on CPU it speeds an MLA file's decoding up and an MQA file's down at
    long context (BENCHMARKS.md), so a report says which path it measured."""

    name = "llama.cpp"

    def __init__(self, device: torch.device, dtype: str, threads: int | None, max_tokens: int, flash_attn: bool):
        from .llama_cpp_bindings import pick_binding

        self.binding = pick_binding()  # refused in one line before anything is loaded
        self.threads, self.max_tokens, self.flash_attn = threads, max_tokens, flash_attn
        self.gpu_layers = -1 if device.type == "cuda" else 0

    def load(self, spec: str, role: str):
        from .llama_cpp_bindings import open_model

        path = Path(spec)
        if path.suffix != ".gguf" or not path.is_file():
            raise SurgeryError(f"--engine llama.cpp takes .gguf files (write one with `surgery export CHECKPOINT "
                               f"--gguf FILE`), got {spec}")
        threads = self.threads or os.cpu_count()  # prefill (batch) threads too: llama.cpp's default is every core
        meta = gguf_metadata(path)
        model = open_model(self.binding, path, self.max_tokens, threads, self.gpu_layers, self.flash_attn)
        model.meta = meta  # the cache each measurement counts
        return {"model": model, "spec": spec, "folder": str(path), "custom_code": False,
                "model_type": meta.get("general.architecture", "llama"),
                "gguf_file_type": gguf_file_type(meta),
                "attention": f"llama.cpp ({model.binding}, flash attention {'on' if model.flash_attn else 'off'})",
                "flash_attn": model.flash_attn,
                "vocab_size": model.n_vocab(), "max_positions": self.max_tokens,
                # what llama.cpp logged it allocated for the whole context (llama-cpp-py-sync only; None elsewhere)
                "llama_cpp_kv_cache": model.kv_cache,
                "llama_cpp_kv_cache_bytes": (round(sum(c["mib"] for c in model.kv_cache) * 2**20)
                                             if model.kv_cache else None)}

    def measure(self, handle: dict, ids: torch.Tensor, next_ids: torch.Tensor, replicate: bool = False) -> dict:
        if ids.shape[0] != 1:
            raise SurgeryError("--engine llama.cpp measures batch 1 only (use --batch 1)")
        model = handle["model"]
        model.reset()
        steps = []
        with PeakMemory(torch.device("cpu")) as peak:
            start = time.perf_counter()
            model.eval(ids[0].tolist())
            prefill = time.perf_counter() - start
            for token in next_ids[0].tolist():
                start = time.perf_counter()
                model.eval([token])
                steps.append(time.perf_counter() - start)
        context = ids.shape[1]
        return {"prefill_s": prefill, "decode_steps_s": steps,
                # K/V in f16 for the context, plus a hybrid's fixed mixer state (f32)
                "kv_cache_bytes": gguf_kv_values(model.meta, context) * 2 * context + gguf_state_bytes(model.meta),
                "peak_memory_bytes": peak.bytes}

    def close(self, handle: dict) -> None:
        model = handle.pop("model", None)
        if model is not None:
            model.close()
