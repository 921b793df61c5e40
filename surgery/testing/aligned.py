"""The aligned K/V merge measured as its tests and benchmarks measure it: a tiny model converted with a small
calibration budget, and its distance to the source (KL per token, largest logit change) on held-out pydoc text that
calibration never reads; a tiny model whose K/V heads merge exactly, up to maps that commute with RoPE."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from surgery.checkpoint.source import resolve_source
from surgery.kv.aligned import convert_aligned
from surgery.kv.options import GQAOptions
from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer, make_tiny

CALIB = 512  # calibration tokens for tiny models (4 windows of their 128-token context)


def heldout_ids(length: int = 128, windows: int = 8) -> torch.Tensor:
    """The first pydoc text (what `surgery check` reads; calibration reads pydoc from its end), char-tokenized."""
    from surgery.data import pydoc_texts

    text = " ".join(pydoc_texts()[:3])
    ids = [ord(c) - 31 if 32 <= ord(c) < 127 else 0 for c in text][: length * windows]
    return torch.tensor(ids).view(windows, length)


@torch.no_grad()
def kl_to_source(src: Path, dst: Path, ids: torch.Tensor) -> tuple[float, float]:
    """Mean KL(source || converted) per token and max |Δlogits| on `ids`."""
    a, b = tm.logits(tm.load(src), ids), tm.logits(tm.load(dst), ids)
    la, lb = F.log_softmax(a, -1), F.log_softmax(b, -1)
    return (la.exp() * (la - lb)).sum(-1).mean().item(), (a - b).abs().max().item()


def aligned(src: Path, out: Path, kv_heads: int, merge=None, **kw) -> dict:
    """`src` merged into `kv_heads` by the aligned merge on CALIB pydoc tokens; `kw`: more of the kind's options,
    `merge`: the merge pipeline's own settings (surgery.kv.aligned.pipeline.MergeOptions)."""
    options = GQAOptions(kv_heads=kv_heads, merge="aligned", calib=["pydoc"], calib_tokens=CALIB, **kw)
    return convert_aligned(resolve_source(str(src)), out, options, progress=False, merge=merge)


# which head dims transformers' rotary embedding pairs up, per family (from each modeling file's rotate function)
ROTARY_PAIRING = {"llama": "half", "cohere": "interleaved", "cohere2": "interleaved", "glm": "interleaved"}


def rotated_copy_heads(arch: str, folder: Path) -> None:
    """A tiny `arch` model whose K/V head 2j + 1 is K/V head 2j up to maps that commute with RoPE: each rotating pair
    of K head 2j + 1 is K head 2j's pair times a complex scalar (a rotation and a scale), its position-free dims are
    any invertible map of K head 2j's; V head 2j + 1 copies V head 2j. Pairs are taken as the family
    rotates them (ROTARY_PAIRING), independently of the registry."""
    model = make_tiny(arch, folder)
    gen = torch.Generator().manual_seed(3)
    rot = 2 * model.model.rotary_emb.inv_freq.numel()
    for layer in model.model.layers:
        attn = layer.self_attn
        d = attn.head_dim
        if ROTARY_PAIRING[arch] == "half":
            a, b = torch.arange(rot // 2), torch.arange(rot // 2) + rot // 2
        else:
            a, b = torch.arange(0, rot, 2), torch.arange(1, rot, 2)
        m = torch.zeros(d, d)  # K head 1 = m @ K head 0
        scale = 0.5 + torch.rand(rot // 2, generator=gen)
        angle = torch.rand(rot // 2, generator=gen) * 6.28
        re, im = scale * torch.cos(angle), scale * torch.sin(angle)
        m[a, a], m[a, b], m[b, a], m[b, b] = re, -im, im, re
        rest = torch.arange(rot, d)
        m[rest[:, None], rest] = torch.eye(len(rest)) + 0.3 * torch.randn(len(rest), len(rest), generator=gen)
        with torch.no_grad():
            for proj, heads_map in ((attn.k_proj, m), (attn.v_proj, torch.eye(d))):
                w = proj.weight.view(-1, d, proj.weight.shape[1])
                w[1::2] = heads_map @ w[0::2]
                if proj.bias is not None:
                    bias = proj.bias.view(-1, d)
                    bias[1::2] = bias[0::2] @ heads_map.T
    model.save_pretrained(folder)
    char_tokenizer(folder)
