"""What a measurement reads: the memory free and the least a batch x context needs (refused before anything is
allocated), peak memory above a starting point (CUDA, or the kernel's peak RSS on Linux), and seconds between two
device synchronizations."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from ..errors import SurgeryError
from .options import BenchOptions

def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device`: CUDA's free memory, or the host's MemAvailable (Linux)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def least_bytes(config, batch: int, context: int, new: int, dtype: str) -> int:
    """A lower bound of what one batch x context measurement allocates: the token ids, one hidden state of the
    prompt and, where the config tells its shape, the KV cache. Anything above this would still not fit."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (hidden // heads if heads else 0))
    tokens = batch * (context + new)
    return tokens * 8 + batch * context * hidden * itemsize + tokens * layers * 2 * kv_heads * head_dim * itemsize


def check_fits(opts: BenchOptions, handle: dict, role: str, device: torch.device) -> None:
    """Refuse (one line) a --batch x --context that cannot fit in the memory left, before anything is allocated."""
    model = handle.get("model")
    free = available_bytes(device)
    if free is None or not hasattr(model, "config"):
        return
    batch, context = max(opts.batches), max(opts.contexts)
    need = least_bytes(model.config, batch, context, opts.new, opts.dtype)
    if need > free:
        raise SurgeryError(f"--batch {batch} x --context {context} needs at least {need / 2**30:.1f} GiB for the "
                           f"{role} model's tokens, hidden states and KV cache, more than the {free / 2**30:.1f} GiB "
                           f"free on {device}: lower --batch or --context")


def _status_bytes(key: str) -> int | None:
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class PeakMemory:
    """Peak memory above the starting point of a `with` block, on CUDA or (Linux) CPU; `bytes` is None when the
    platform cannot tell."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
                self._start = _status_bytes("VmRSS")
            except OSError:
                self._start = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self._start is not None:
            peak = _status_bytes("VmHWM")
            self.bytes = None if peak is None else max(0, peak - self._start)
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SyncedTimer:
    """Seconds of a `with` block on `device`, read between two synchronizations: what was queued before it is done
    before the clock starts, and what it queued is done before the clock stops (CUDA runs asynchronously)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, None

    def __enter__(self):
        _sync(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync(self.device)
        self.seconds = time.perf_counter() - self._start
        return False
