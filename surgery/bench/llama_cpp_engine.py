"""The llama.cpp engine (llama-cpp-python on GGUF files), and the KV cache it allocates, counted from a GGUF's
metadata."""

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
