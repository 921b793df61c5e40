"""Where a loaded model came from, for the record of what is converted from it (surgery.json's `source`, the card's
`base_model`): a hub id and the commit its weights were loaded at, a local folder's name, or nothing (a model built
in memory). Never a machine path; never a lineage the model does not show."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

COMMIT = re.compile(r"[0-9a-f]{40}")
COMPARED_BYTES = 64 << 20  # of a cached snapshot's smallest tensors compared with the model's to tell its commit


def model_lineage(model: Any) -> dict:
    """`{"loaded": "hub", "spec": "org/name", "commit": "<sha>" or None}` for a model loaded by hub id;
    `{"loaded": "folder", "spec": "<the folder's name>", "commit": None}` for one loaded from a local folder;
    `{"loaded": "memory", "spec": None, "commit": None}` for a model built in memory (`from_config`), which names
    no checkpoint even when its config was loaded from one (its name_or_path then names the config's checkpoint, not
    the weights'). transformers 5 attaches the renamings it applied to a checkpoint's weights (`_weight_conversions`)
    to a model whose weights it loaded, and to no other: a model without them is counted as built in memory rather
    than given a lineage it may not have."""
    from ..checkpoint.record import looks_like_hub_id

    if not hasattr(model, "_weight_conversions"):
        return {"loaded": "memory", "spec": None, "commit": None}
    config = getattr(model, "config", None)
    name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
    name = name if isinstance(name, str) else ""
    if name and looks_like_hub_id(name):
        return {"loaded": "hub", "spec": name, "commit": hub_commit(model, name)}
    if name:
        return {"loaded": "folder", "spec": Path(name).expanduser().name or None, "commit": None}
    return {"loaded": "memory", "spec": None, "commit": None}


def hub_commit(model: Any, repo_id: str) -> str | None:
    """The commit of `repo_id` the model's weights were loaded at: `config._commit_hash` where transformers keeps
    it (4.x); else (transformers 5 resolves the revision without keeping it) the one snapshot of the repo in
    huggingface_hub's cache whose weights are the model's (its smallest tensors compared, up to COMPARED_BYTES). None when
    no snapshot, or several, match: no commit is guessed."""
    commit = getattr(getattr(model, "config", None), "_commit_hash", None)
    if isinstance(commit, str) and COMMIT.fullmatch(commit):
        return commit
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    state = model.state_dict()
    matches = [s.name for s in sorted(snapshots.iterdir()) if COMMIT.fullmatch(s.name) and _same_weights(s, state)]
    return matches[0] if len(matches) == 1 else None


def _same_weights(folder: Path, state: dict) -> bool:
    """The tensors of `folder`'s safetensors files that the model has, smallest first (norms, biases, then small
    matrices) up to COMPARED_BYTES read, equal the model's (cast to its dtype, as from_pretrained casts them): a
    commit that changed any of them is told apart without reading a large checkpoint whole. False when none can be
    compared."""
    import torch
    from safetensors import safe_open

    try:
        handles = [safe_open(str(path), framework="pt") for path in sorted(folder.glob("*.safetensors"))]
        sizes = []
        for h in handles:
            for name in h.keys():
                if name in state:
                    shape = h.get_slice(name).get_shape()
                    sizes.append((int(torch.tensor(shape).prod().item()) if shape else 1, name, h))
        sizes.sort(key=lambda t: (t[0], t[1]))
        read = 0
        for count, name, h in sizes:
            mine = state[name].detach()
            if read and read + count * mine.element_size() > COMPARED_BYTES:
                break
            if not torch.equal(h.get_tensor(name).to(mine.dtype), mine.cpu()):
                return False
            read += count * mine.element_size()
        return read > 0
    except (OSError, ValueError, RuntimeError):  # an incomplete or odd file: not a match
        return False
