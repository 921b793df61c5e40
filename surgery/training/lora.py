"""LoRA uptraining (`uptrain --lora-rank R`, through peft): low-rank adapters on chosen linear layers train,
everything else stays frozen, so the optimizer state is that of the adapters alone.

`--lora-targets` picks the layers: comma-separated shell-style patterns matched against module names as
`params.matches` does (whole name, or a suffix after a dot: `q_proj`, `self_attn.*`, `mlp.down_proj`); default:
every nn.Linear inside an attention block (self_attn, attn, attention, self_attention), which includes the
projections of the toolkit's own attention kinds where they are nn.Linear. At the end the adapters are merged
into the weights (`--merge-lora`, default: the output is a standard checkpoint with the input's tensor names
and shapes) or, with `--no-merge-lora`, the output keeps the input's weights and the adapter is written beside
them in OUT/adapter (peft's format: `PeftModel.from_pretrained(model, OUT/adapter)`).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..errors import SurgeryError
from .params import ATTENTION, matches

ADAPTER_DIR = "adapter"


def require_peft():
    try:
        import peft
    except ImportError:
        raise SurgeryError("--lora-rank needs peft: pip install 'attention-surgery[lora]' (or pip install peft)") from None
    return peft


def target_modules(model, targets: str | None) -> list[str]:
    """Full names of the nn.Linear modules that get adapters."""
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
    if targets:
        patterns = [p.strip() for p in targets.split(",") if p.strip()]
        chosen = [n for n in linear if any(matches(n, p) for p in patterns)]
        what = f"--lora-targets {targets!r} matches"
    else:
        chosen = [n for n in linear if ATTENTION.search(n + ".")]
        what = "the attention blocks hold"
    if not chosen:
        raise SurgeryError(f"--lora-rank: {what} no nn.Linear module of the model")
    return chosen


def wrap(model, rank: int, alpha: float | None, targets: str | None, dropout: float = 0.0):
    """The model with LoRA adapters of `rank` on the target modules; only the adapters train."""
    peft = require_peft()
    names = target_modules(model, targets)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                             target_modules=names, bias="none")
    return peft.get_peft_model(model, config), names


def unwrap(model, merge: bool, out: Path):
    """The base model for saving: adapters merged into the weights, or written to OUT/adapter and removed."""
    if merge:
        return model.merge_and_unload()
    model.save_pretrained(out / ADAPTER_DIR)
    return model.unload()
