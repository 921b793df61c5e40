"""A decoder layer's checkpoint tensors in the layout transformers keeps in memory.

transformers v5 renames some checkpoint tensors when it loads a model, and merges others: a mixture-of-experts
layer stores `experts.0.w1.weight`, `experts.1.w1.weight`, ... and `w3` in the checkpoint but one
`experts.gate_up_proj` in memory. Layer streaming reads the checkpoint itself, so it applies the same rules, read
from transformers' own conversion mapping for the model type, to one layer at a time. Supported: renamings, and
converters made of stacking per-expert tensors (MergeModulelist) and concatenating the stacks (Concatenate).
"""

from __future__ import annotations

import re
from typing import Callable

import torch

Loader = Callable[[], torch.Tensor]


def _rules(model_type: str) -> list:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without weight conversion: checkpoint names are the in-memory names
        return []
    return list(get_checkpoint_conversion_mapping(model_type) or [])


def memory_layout(model_type: str, names: dict[str, str], load: Callable[[str], torch.Tensor]) -> dict[str, Loader]:
    """{name inside the layer, as in memory: function loading its tensor}, from {name inside the layer, as in the
    checkpoint: checkpoint tensor name}."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    keys = {"." + rel: source for rel, source in names.items()}
    rules = _rules(model_type)
    for rule in rules:
        if isinstance(rule, WeightRenaming):
            for src, dst in zip(rule.source_patterns, rule.target_patterns):
                keys = {re.sub(src, dst, k): v for k, v in keys.items()}
    loaders: dict[str, Loader] = {k: (lambda s=v: load(s)) for k, v in keys.items()}
    for rule in rules:
        if not isinstance(rule, WeightConverter) or len(rule.target_patterns) != 1:
            continue
        ops = [type(op).__name__ for op in rule.operations]
        if not ops or ops[0] != "MergeModulelist" or not set(ops) <= {"MergeModulelist", "Concatenate"}:
            continue
        patterns = [re.compile(re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in rule.source_patterns]
        groups: dict[str, list[dict[int, str]]] = {}
        for key in list(loaders):
            for index, pattern in enumerate(patterns):
                m = pattern.search(key)
                if m:
                    parts = groups.setdefault(key[: m.start()], [{} for _ in patterns])
                    parts[index][int(m.group(1))] = key
                    break
        for prefix, parts in groups.items():
            if not all(parts) or any(sorted(p) != list(range(len(p))) for p in parts):
                continue  # incomplete: leave the tensors as they are (the caller names what is missing)
            members = [[loaders.pop(p[i]) for i in sorted(p)] for p in parts]
            target = rule.target_patterns[0]
            name = prefix + (target if target.startswith(".") or not prefix.endswith(".") else target)
            if not name.startswith("."):
                name = "." + name
            loaders[name] = _merged(members, rule.operations)
    return {k[1:]: v for k, v in loaders.items()}


def _merged(members: list[list[Loader]], operations) -> Loader:
    def load() -> torch.Tensor:
        stacks = [torch.stack([f() for f in group], dim=operations[0].dim) for group in members]
        for op in operations[1:]:
            stacks = [torch.cat(stacks, dim=op.dim)]
        return stacks[0]

    return load
