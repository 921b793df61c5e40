"""Run under `accelerate launch` by benchmarks/gpu/steps.py (the fsdp2-launch step): load MODEL as `surgery uptrain`
does (surgery.uptrain.model_io), prepare it with uptraining's own Accelerator (surgery.uptrain.loop), and write to
OUT the dtypes of every RoPE inv_freq buffer after `prepare` and their largest error against the fp32 tables of
the model loaded plainly (FSDP1 casts buffers to bf16: positions then drift by radians at 4k tokens).

Usage: accelerate launch --config_file CONFIG benchmarks/gpu/fsdp_probe.py MODEL OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from surgery.checkpoint.source import resolve_source
from surgery.uptrain import model_io
from surgery.uptrain.loop import make_accelerator


def inv_freqs(model) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}


def main() -> None:
    folder, out = sys.argv[1], Path(sys.argv[2])
    acc = make_accelerator()
    source = resolve_source(folder)
    model = model_io.load_causal_lm(source, "model")
    reference = {n: b.detach().clone().float().cpu() for n, b in inv_freqs(model).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = acc.prepare(model, optimizer)
    found = inv_freqs(acc.unwrap_model(model)) or inv_freqs(model)
    dtypes = sorted({str(b.dtype) for b in found.values()})
    error = max(((b.detach().float().cpu() - reference[n.split("_fsdp_wrapped_module.")[-1]]).abs().max().item()
                 if n.split("_fsdp_wrapped_module.")[-1] in reference else float("inf"))
                for n, b in found.items()) if found else float("inf")
    if acc.is_main_process:
        out.write_text(json.dumps(dict(inv_freq_dtypes=dtypes, inv_freq_max_abs_error=error, buffers=len(found),
                                       distributed_type=str(acc.distributed_type),
                                       mixed_precision=acc.mixed_precision)))
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
