"""Which parameters an uptraining run trains: all, the attention (projections and new parameters), or only
the parameters the conversion introduced (listed as patterns under "new_parameters" in surgery.json; the
contract is described in `surgery/training/__init__.py`)."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

from ..errors import SurgeryError

# Attention blocks across the transformers architectures (self_attn: Llama family, Phi3; attn: GPT-2,
# GPTBigCode; attention: GPT-NeoX, BERT-likes; self_attention: Falcon, Bloom).
ATTENTION = re.compile(r"(?:^|\.)(?:self_attn|attn|attention|self_attention)\.")


def matches(name: str, pattern: str) -> bool:
    """Whole-name match, or a match of a suffix that starts right after a dot."""
    return fnmatchcase(name, pattern) or fnmatchcase(name, "*." + pattern)


def new_parameter_patterns(record: dict) -> list[str]:
    patterns = record.get("new_parameters") or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        raise SurgeryError('surgery.json: "new_parameters" must be a list of name patterns')
    return [p.replace("{layer}", "*") for p in patterns]


def new_parameter_names(names: list[str], record: dict) -> set[str]:
    selected: set[str] = set()
    for pattern in new_parameter_patterns(record):
        hits = {n for n in names if matches(n, pattern)}
        if not hits:
            raise SurgeryError(f"surgery.json lists new parameters {pattern!r}, but the model has no parameter matching it")
        selected |= hits
    return selected


def select_trainable(model, train: str, record: dict) -> list[str]:
    """Set requires_grad by `train` (all | attention | new); returns the names of the trainable parameters."""
    names = [n for n, _ in model.named_parameters()]
    if train == "all":
        chosen = set(names)
    elif train == "new":
        chosen = new_parameter_names(names, record)
        if not chosen:
            kind = record.get("kind", "this checkpoint")
            raise SurgeryError(f"--train new: the conversion ({kind}) introduced no new parameters (surgery.json lists "
                               "none under new_parameters); use --train attention or --train all")
    elif train == "attention":
        chosen = {n for n in names if ATTENTION.search(n)} | new_parameter_names(names, record)
        if not chosen:
            raise SurgeryError("--train attention: found no attention parameters (no module named self_attn, attn, "
                               "attention or self_attention); use --train all")
    else:
        raise SurgeryError(f"unknown --train {train!r}")
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
    return [n for n in names if n in chosen]


def new_parameters(model, record: dict) -> list:
    """The conversion's new parameters (surgery.json's new_parameters) among the model's, for their own optimizer
    group (--new-lr); none where the record lists none."""
    names = [n for n, _ in model.named_parameters()]
    chosen = new_parameter_names(names, record) if record.get("new_parameters") else set()
    return [p for n, p in model.named_parameters() if n in chosen]
