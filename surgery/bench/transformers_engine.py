"""The transformers engine: the models' own classes (sdpa, or a converted checkpoint's code), a prefill that fills a
fresh transformers cache and single-token decode steps on it, the cache's bytes read from its tensors."""

from __future__ import annotations

import torch

from ..errors import SurgeryError
from ..runtime import cache_keyword, returned_cache
from .measure import PeakMemory, SyncedTimer
from .options import role_trust

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


class TransformersEngine:
    """transformers' model classes: sdpa for standard models, the checkpoint's own code for converted kinds."""

    name = "transformers"

    def __init__(self, device: torch.device, dtype: str, trusted: dict[str, bool], compile: str | None = None):
        from transformers.utils import logging as hf_logging

        self.device, self.dtype, self.trusted, self.compile = device, dtype, trusted, compile
        hf_logging.disable_progress_bar()

    def preflight(self, spec: str, role: str) -> bool:
        """Refuse before anything is loaded; the `trust_remote_code` to load `spec` (the `role` model) with."""
        from ..checkpoint.source import resolve_source

        return role_trust(resolve_source(spec).folder, role, self.trusted, spec)

    def load(self, spec: str, role: str):
        from ..runtime import load_model
        from ..checkpoint.source import resolve_source

        from ..kinds import check_checkpoint

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


def _max_positions(config) -> int | None:
    text = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions"):
        if getattr(text, key, None):
            return int(getattr(text, key))
    return None
