"""`run_bench`: both models loaded, warmed up and measured in alternating rounds at every batch x context, by the
engine the options pick; the report with every raw round."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import sys
import time
from typing import Callable

import torch

from ..dtypes import DTYPE_NAMES
from ..errors import SurgeryError
from ..precision import load_dtype
from .llama_cpp_engine import LlamaCppEngine
from .measure import SyncedTimer, check_fits
from .options import BenchOptions, require_compile, require_engine, require_engine_dtype, resolve_flash_attn, trusted_roles
from .stats import derived, ratios, summarize
from .transformers_engine import TransformersEngine
from .vllm_engine import VllmEngine

def make_engine(opts: BenchOptions, device: torch.device):
    require_engine(opts.engine)
    require_compile(opts.compile, opts.engine, device)
    longest = max(opts.contexts) + opts.new
    if opts.engine == "llama.cpp":
        return LlamaCppEngine(device, opts.dtype, opts.threads, longest,
                              flash_attn=resolve_flash_attn(opts.flash_attn, opts.engine) == "on")
    if opts.engine == "vllm":
        if device.type != "cuda":
            raise SurgeryError("--engine vllm needs a CUDA device")
        return VllmEngine(device, opts.dtype, trusted_roles(opts), longest)
    return TransformersEngine(device, opts.dtype, trusted_roles(opts), opts.compile)


def machine_info(device: torch.device, threads: int) -> dict:
    import transformers

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device), "threads": threads}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda s: None,
              partial: Callable[[dict], None] | None = None) -> dict:
    from ..runtime import pick_device

    if opts.rounds < 1 or opts.new < 1:
        raise SurgeryError("--rounds and --new must be at least 1")
    if opts.dtype is not None and opts.dtype not in DTYPE_NAMES:
        raise SurgeryError(f"--dtype {opts.dtype}: choose float32, bfloat16 or float16")
    try:
        load_dtype(opts.precision, opts.dtype, "cpu")  # a contradiction is refused before a device is touched
    except ValueError as e:
        raise SurgeryError(str(e)) from None
    require_engine_dtype(opts.dtype, opts.engine)
    if opts.replicate_prefill and opts.engine != "transformers":
        raise SurgeryError("--replicate-prefill works with the transformers engine only")
    if opts.threads is not None and opts.threads < 1:
        raise SurgeryError(f"--threads must be at least 1, got {opts.threads}")
    resolve_flash_attn(opts.flash_attn, opts.engine)  # before a device or a model is touched
    device = pick_device(opts.device)
    opts = dataclasses.replace(opts, dtype=load_dtype(opts.precision, opts.dtype, device))
    engine = make_engine(opts, device)
    before_threads = torch.get_num_threads()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    try:
        return _run(opts, engine, device, log, partial)
    finally:
        torch.set_num_threads(before_threads)


def _run(opts: BenchOptions, engine, device: torch.device, log, partial=None) -> dict:
    started = time.time()
    start_info = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "machine": machine_info(device, torch.get_num_threads())}  # load average at the start
    for role, spec in (("source", opts.source), ("converted", opts.converted)):
        if hasattr(engine, "preflight"):
            engine.preflight(spec, role)
    handles = {}
    for role, spec in (("source", opts.source), ("converted", opts.converted)):
        with SyncedTimer(device) as load:
            handles[role] = engine.load(spec, role)
        handles[role]["load_s"] = load.seconds
    vocab = min(h["vocab_size"] for h in handles.values())
    for role, h in handles.items():
        if h["max_positions"] and max(opts.contexts) + opts.new > h["max_positions"]:
            raise SurgeryError(f"--context {max(opts.contexts)} + --new {opts.new} exceeds the {role} model's "
                               f"{h['max_positions']} positions")
    for role, h in handles.items():
        check_fits(opts, h, role, device)
    gen = torch.Generator().manual_seed(opts.seed)
    warm = torch.randint(0, vocab, (1, min(32, min(opts.contexts))), generator=gen)
    for h in handles.values():  # warm-up: first calls allocate and pick kernels
        engine.measure(h, warm, warm[:, :2])
    results = []
    for batch in opts.batches:
        for context in opts.contexts:
            ids = torch.randint(0, vocab, (batch, context), generator=gen)
            next_ids = torch.randint(0, vocab, (batch, opts.new), generator=gen)
            rounds = {"source": [], "converted": []}
            replicate = opts.replicate_prefill and batch > 1
            prefill_batch = 1 if replicate else batch
            compile_s = {}
            if opts.compile:  # compiled graphs are made for the first calls of a shape: not measured
                for role, h in handles.items():
                    with SyncedTimer(device) as warmup:
                        engine.measure(h, ids, next_ids[:, :2], replicate=replicate)
                    compile_s[role] = round(warmup.seconds, 2)
                log(f"batch {batch} context {context}: compiled in {compile_s['source']:.0f} s (source) and "
                    f"{compile_s['converted']:.0f} s (converted)")
            for r in range(opts.rounds):
                order = ("source", "converted") if r % 2 == 0 else ("converted", "source")
                for role in order:
                    raw = engine.measure(handles[role], ids, next_ids, replicate=replicate)
                    rounds[role].append({"round": r, **raw, **derived(raw, batch, context, prefill_batch)})
                log(f"batch {batch} context {context} round {r + 1}/{opts.rounds}: decode "
                    f"{rounds['source'][-1]['decode_tokens_per_s']:.1f} vs "
                    f"{rounds['converted'][-1]['decode_tokens_per_s']:.1f} tokens/s")
            summary = {role: summarize(rs) for role, rs in rounds.items()}
            results.append({"batch": batch, "context": context, "prefill_batch": prefill_batch, **summary,
                            "ratio": ratios(summary["source"], summary["converted"]), "rounds": rounds,
                            **({"compile_warmup_s": compile_s} if opts.compile else {})})
            if partial is not None:  # the report so far, after every batch x context (long runs)
                partial(_report(opts, engine, handles, results, started, start_info))
    report = _report(opts, engine, handles, results, started, start_info)
    for h in handles.values():
        engine.close(h)
    return report


def _report(opts: BenchOptions, engine, handles: dict, results: list, started: float, start_info: dict) -> dict:
    models = {role: {k: v for k, v in h.items() if k not in ("model", "config")} for role, h in handles.items()}
    return {
        "command": "surgery bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
        "date": start_info["date"],
        "seconds": time.time() - started,
        "engine": engine.name,
        # llama.cpp runs each GGUF's weights as stored: their type, read from each file
        "dtype": (opts.dtype if engine.name != "llama.cpp" else
                  "GGUF " + " / ".join(dict.fromkeys(h["gguf_file_type"] for h in handles.values()))),
        "precision": opts.precision,
        "new_tokens": opts.new,
        "rounds": opts.rounds,
        "replicate_prefill": opts.replicate_prefill,
        "compile": opts.compile,
        "flash_attn": resolve_flash_attn(opts.flash_attn, opts.engine),  # "on" / "off" (llama.cpp), else None
        "batches": opts.batches,
        "contexts": opts.contexts,
        "machine": start_info["machine"],
        "models": models,
        "results": results,
    }
