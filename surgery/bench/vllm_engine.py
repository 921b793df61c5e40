"""The vLLM engine (its offline LLM on CUDA), and the KV cache counted from a checkpoint's config by the kind that
wrote it."""

from __future__ import annotations

import time

import torch

from .options import role_trust

def kv_bytes_from_config(config: dict, tokens: int, element_size: int, engine: str = "vllm",
                         record: dict | None = None) -> int:
    """KV-cache bytes for `tokens` tokens by the config (engines that do not expose their cache tensors): what the
    kind that wrote the checkpoint (its config, its surgery.json `record`) says `engine` caches (surgery/kinds)."""
    from ..arch import attention_shape
    from ..kinds import AttentionShape, kv_cache_values

    text = config.get("text_config") or config
    s = attention_shape(text)
    shape = AttentionShape(s["layers"], s["heads"], s["kv_heads"], s["head_dim"], s["hidden"])
    return kv_cache_values(shape, text, record, context=tokens)[engine] * tokens * element_size


class VllmEngine:
    """vLLM's offline LLM: prefill = a generation of one token; decode step = (time of `new` tokens - that) /
    (new - 1). The KV cache is counted from the config (vLLM preallocates its blocks)."""

    name = "vllm"

    def __init__(self, device: torch.device, dtype: str, trusted: dict[str, bool], max_tokens: int):
        self.dtype, self.trusted, self.max_tokens = dtype, trusted, max_tokens

    def load(self, spec: str, role: str):
        from vllm import LLM

        from ..checkpoint.record import read_record
        from ..checkpoint.source import resolve_source

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
