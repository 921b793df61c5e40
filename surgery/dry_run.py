"""`surgery convert --dry-run`: what the conversion will need, before anything is read beyond headers and config."""

from __future__ import annotations

from dataclasses import asdict

import torch

from .errors import SurgeryError
from .source import Source
from .tensors import CheckpointReader, dtype_size

STREAMED_NOTE = ("no calibration: streamed tensor by tensor (about 3x the largest tensor in memory; the time is the "
                 "time to read and write the checkpoint)")


def _sig(x: float) -> float:
    """Four significant digits (a tiny model's layer takes milliseconds)."""
    return float(f"{x:.4g}")


def source_dtype(reader: CheckpointReader) -> torch.dtype:
    """The dtype holding most of the checkpoint's floating parameters."""
    counts: dict[torch.dtype, int] = {}
    for t in reader.tensors.values():
        if t.dtype.is_floating_point:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
    return max(counts, key=counts.get) if counts else torch.float32


def convert_dry_run(src: Source, kind: str, *, method: str = "mean", kv_heads: int | None = None,
                    assign: bool = True, heads: int | None = None, experts: int | None = None, topk: int | None = None,
                    calib_tokens: int = 8192, device: str = "auto", allow_pickle: bool = False) -> dict:
    """The estimate `surgery convert ... --dry-run` prints: {"lines": [...], and the numbers}."""
    from .calibration.stream import pick_device
    from .calibration.stream import RUNTIME_BYTES
    from .estimate import estimate_calibrated, probe_throughput
    from .merge.convert import _n_threads
    from .recipes.estimate import human_bytes

    if kind == "mqa":
        kv_heads = 1
    elif kind == "gqa" and kv_heads is None:
        raise SurgeryError("--to gqa needs --kv-heads N")
    if kind == "switchhead" and None in (heads, experts, topk):
        raise SurgeryError("--to switchhead needs --heads H --experts E --topk K")
    if calib_tokens < 1:
        raise SurgeryError(f"--calib-tokens must be positive, got {calib_tokens}")
    config = src.config
    with CheckpointReader(src.folder, allow_pickle=allow_pickle) as reader:
        dtype = source_dtype(reader)
        total = sum(t.numel * dtype_size(t.dtype) for t in reader.tensors.values())
        largest = max(t.numel * dtype_size(t.dtype) for t in reader.tensors.values())
    head = f"{src.spec}: {config.get('model_type')}, {human_bytes(total)} of weights ({str(dtype).removeprefix('torch.')})"
    calibrated = (kind in ("mqa", "gqa") and method == "aligned") or (kind == "switchhead" and experts > 1)
    if not calibrated:
        host = RUNTIME_BYTES + 3 * largest
        return {"kind": kind, "calibrated": False, "checkpoint_bytes": total, "host_bytes": host, "device_bytes": 0,
                "lines": [head, f"estimate for {kind}: peak host memory {human_bytes(host)}", f"  {STREAMED_NOTE}"]}
    dev = pick_device(device)
    rate = probe_throughput(dev, threads_float32=_n_threads() if dev.type == "cpu" else None)
    name = "aligned" if kind in ("mqa", "gqa") else "switchhead"
    est = estimate_calibrated(config, name, calib_tokens, dtype=str(dtype).removeprefix("torch."), device=str(dev),
                              kv_heads=kv_heads, assign=assign, heads=heads, experts=experts, topk=topk, throughput=rate)
    return {"kind": name, "calibrated": True, "checkpoint_bytes": total, "host_bytes": est.host_bytes,
            "device_bytes": est.device_bytes, "seconds_per_layer": _sig(est.seconds_per_layer),
            "cpu_seconds_per_layer": _sig(est.cpu_seconds_per_layer) if est.cpu_seconds_per_layer else None,
            "seconds": _sig(est.seconds), "layers": est.layers, "tokens": est.tokens, "device": est.device,
            "flops_per_layer": asdict(est.flops_per_layer), "throughput": asdict(est.throughput),
            "memory_terms": est.memory, "lines": [head, *est.lines()]}
