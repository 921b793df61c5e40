"""Running a model: where it runs (`pick_device`), on how many torch threads (`threads`, `compute_threads`), the
model, its config and its tokenizer loaded from a source, its context length and the token windows it reads, and
the keyword its forward takes its KV cache by. Everything that runs a model (calibration, the merge, SwitchHead,
check, bench, uptrain) gets these from here."""

from __future__ import annotations

import inspect
import os

import torch

from .errors import SurgeryError
from .checkpoint.source import LINEAGE_FILE, Source
from .checkpoint.tensors import DTYPES
from .threads import threads  # noqa: F401 - the runtime's helpers in one place for its users


# ---- where and on how many threads --------------------------------------------------------------------------------
def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SurgeryError(f"--device {device}: CUDA is not available on this machine")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SurgeryError(f"bad device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SurgeryError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def compute_threads() -> int:
    """Compute threads for calibration: the cores not already busy with other processes (1-minute load).

    On a shared machine, more threads than idle cores only spin against each other: measured here, a forward
    pass took twice the CPU time and twice the wall time with 2 threads instead of 1 on 2 busy cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    busy = int(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(cores, cores - busy + 1))


# ---- loading from a source ----------------------------------------------------------------------------------------
def is_causal_lm(config) -> bool:
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))


def load_model(source: Source, device: torch.device, dtype: str, trust_remote_code: bool = False,
               attn_implementation: str | None = None):
    """The checkpoint as a model on `device`. Refuses (one line) a checkpoint that lacks tensors its config needs,
    or whose tensors do not fit its config."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        config = AutoConfig.from_pretrained(source.folder, trust_remote_code=trust_remote_code)
        auto = AutoModelForCausalLM if is_causal_lm(config) else AutoModel
        model, info = auto.from_pretrained(source.folder, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
                                           output_loading_info=True, **extra)
    except (OSError, ValueError, RuntimeError) as e:
        raise SurgeryError(f"cannot load {source.spec}: {str(e).splitlines()[0]}") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise SurgeryError(f"cannot load {source.spec}: its weights lack {len(missing)} tensor(s) its config needs "
                           f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    return model.to(device).eval()


SAVED_TOKENIZER = ("tokenizer_config.json", "tokenizer.json")  # what a tokenizer's save_pretrained writes


def load_tokenizer(source: Source, trust_remote_code: bool = False):
    """The source's tokenizer. transformers reads the folder's config on the way: for a folder with its own modeling
    code it runs that code with `trust_remote_code`, and without it would stop to ask on the terminal."""
    from transformers import AutoTokenizer

    folder = source.folder
    if (folder / LINEAGE_FILE).is_file() and not any((folder / f).is_file() for f in SAVED_TOKENIZER):
        raise SurgeryError("the loaded model was given with no tokenizer (it was not loaded from a local folder that "
                           "has one): pass tokenizer=... with it")  # saved by the API (surgery/api/sources.py)
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise SurgeryError(f"cannot load the tokenizer of {source.spec}: {str(e).splitlines()[0]}") from None


def load_model_config(source: Source, trust_remote_code: bool = False):
    """The source's transformers config object (surgery.checkpoint.source.load_config reads config.json as a dict)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SurgeryError(f"cannot read the config of {source.spec}: {str(e).splitlines()[0]}") from None


def context_length(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


def windows(ids: torch.Tensor, seq_len: int, what: str = "the data") -> torch.Tensor:
    """A token stream cut into whole windows of `seq_len` tokens (the rest dropped)."""
    n = ids.numel() // seq_len
    if n == 0:
        raise SurgeryError(f"need at least {seq_len} tokens, {what} gave {ids.numel()}")
    return ids[: n * seq_len].view(n, seq_len)


# ---- the KV cache keyword -----------------------------------------------------------------------------------------
# transformers 5.24 renamed `past_key_values` to `cache` (the old name still works, with a warning, until 5.40);
# earlier 5.x know only the old name.
def takes_keyword(model, name: str) -> bool:
    """Whether the model's class names `name` among its forward's parameters (the class's forward: a compiled
    instance forward hides its signature)."""
    return name in inspect.signature(type(model).forward).parameters


def cache_keyword(model) -> str:
    """`cache` where the model's class takes it, else `past_key_values`."""
    return "cache" if takes_keyword(model, "cache") else "past_key_values"


def forward_keeping(model, ids: torch.Tensor, keep: int, **kwargs):
    """`model(input_ids=ids, **kwargs)` keeping the logits of the last `keep` positions only (`logits_to_keep`)
    where the model's class takes it; a model that does not returns its whole logits, for the caller to slice."""
    if takes_keyword(model, "logits_to_keep"):
        return model(input_ids=ids, logits_to_keep=keep, **kwargs)
    return model(input_ids=ids, **kwargs)


def returned_cache(output):
    """The KV cache a forward with use_cache=True returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
