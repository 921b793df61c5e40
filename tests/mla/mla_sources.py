"""The MLA tests' sources and conversion: tiny Llama-like models with a chosen number of K/V heads and head size,
norms moved off one, and a character tokenizer; `--to mla` run as a library with a small calibration budget."""

from __future__ import annotations

import torch
import transformers as tf

from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

CALIB = 512


def tiny_llama(folder, kv_heads: int, head_dim: int = 16, seed: int = 0, family: str = "LlamaConfig", **kw):
    torch.manual_seed(seed)
    config = getattr(tf, family)(**(tm.COMMON | tm.TOKENS | kw), num_attention_heads=4,
                                 num_key_value_heads=kv_heads, head_dim=head_dim)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    char_tokenizer(folder)
    return folder


def convert(src, out, rank: int, absorb: bool = True, refit_queries: bool = True, **kw):
    """`src` converted to MLA of latent rank `rank` on CALIB pydoc tokens; `kw`: more of the kind's options."""
    from surgery.mla import convert_to_mla
    from surgery.mla.options import MLAOptions
    from surgery.checkpoint.source import resolve_source

    options = MLAOptions(kv_rank=rank, calib=["pydoc"], calib_tokens=CALIB, **kw)
    return convert_to_mla(resolve_source(str(src)), out, options, progress=False, absorb=absorb,
                          refit_queries=refit_queries)
