"""`surgery convert --dry-run`: what the conversion will need, before anything is read beyond headers and config."""

from __future__ import annotations

from dataclasses import asdict

import torch

from .errors import SurgeryError
from .general_text import describe_texts
from .checkpoint.source import Source
from .checkpoint.tensors import CheckpointReader, dtype_size

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


def convert_dry_run(src: Source, kind, options) -> dict:
    """The estimate `surgery convert ... --dry-run` prints for `kind` (surgery/kinds) with its validated `options`:
    {"lines": [...], and the numbers}."""
    from .calibration.stream import RUNTIME_BYTES
    from .runtime import pick_device
    from .estimate import probe_throughput
    from .runtime import compute_threads
    from .units import human_bytes

    config = src.config
    with CheckpointReader(src.folder, allow_pickle=options.allow_pickle) as reader:
        if not reader.tensors:  # as the conversion itself would refuse it, before estimating from nothing
            raise SurgeryError(f"{src.spec}: the checkpoint's weight files hold no tensors")
        dtype = source_dtype(reader)
        total = sum(t.numel * dtype_size(t.dtype) for t in reader.tensors.values())
        largest = max(t.numel * dtype_size(t.dtype) for t in reader.tensors.values())
    head = f"{src.spec}: {config.get('model_type')}, {human_bytes(total)} of weights ({str(dtype).removeprefix('torch.')})"
    if not kind.calibrates(options):
        host = RUNTIME_BYTES + 3 * largest
        return {"kind": kind.name, "calibrated": False, "checkpoint_bytes": total, "host_bytes": host,
                "device_bytes": 0,
                "lines": [head, f"estimate for {kind.name}: peak host memory {human_bytes(host)}", f"  {STREAMED_NOTE}"]}
    texts = describe_texts(options.calib)
    dev = pick_device(options.device)
    rate = probe_throughput(dev, threads_float32=compute_threads() if dev.type == "cpu" else None)
    est = kind.calibration_estimate(config, options, dtype=str(dtype).removeprefix("torch."), device=str(dev),
                                    throughput=rate)
    if est is None:  # a calibrated kind without a cost model yet
        return {"kind": kind.name, "calibrated": True, "checkpoint_bytes": total, "host_bytes": None,
                "device_bytes": None, "lines": [head, f"estimate for {kind.name}: not modelled yet"]}
    return {"kind": est.kind, "calibrated": True, "checkpoint_bytes": total, "host_bytes": est.host_bytes,
            "device_bytes": est.device_bytes, "seconds_per_layer": _sig(est.seconds_per_layer),
            "cpu_seconds_per_layer": _sig(est.cpu_seconds_per_layer) if est.cpu_seconds_per_layer else None,
            "seconds": _sig(est.seconds), "layers": est.layers, "tokens": est.tokens, "device": est.device,
            "chunk_windows": est.chunk_windows,
            "flops_per_layer": asdict(est.flops_per_layer), "throughput": asdict(est.throughput),
            "memory_terms": est.memory, "calib": texts, "lines": [head, f"calibration text: {' + '.join(texts)}{_retrieval_note(options)}",
                                                                    *est.lines()]}


def _retrieval_note(options) -> str:
    """The calibration line's note on --calib-retrieval-mix (and --retrieval-weight), when given."""
    mix = getattr(options, "calib_retrieval_mix", 0.0)
    if not mix:
        return ""
    weight = getattr(options, "retrieval_weight", 0.0)
    return (f" ({mix:g} of the windows retrieval examples"
            + (f"; retrieval heads weighted, B = {weight:g}" if weight else "") + ")")
