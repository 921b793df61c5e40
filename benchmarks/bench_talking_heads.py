"""Talking-heads SmolLM2-135M against its source: forward time and peak memory, as ratios measured in one run.

    python benchmarks/bench_talking_heads.py [--lengths 512 1024 2048] [--repeats 2] [--threads N] [--device cpu|cuda]

Time: one forward (batch 1, T tokens, no KV cache, `logits_to_keep=1`, so the shared LM head does not dilute the
ratio) of the source with eager attention, the source with sdpa, and the converted model (query chunks of 512).
The models run interleaved, `repeats` times each after one warm-up, and the median is kept, so that load on a
shared machine hits all of them alike; CPU seconds of the process are printed beside wall-clock seconds because
they are much less sensitive to other processes on the machine (use --threads 1 on a busy machine).

Memory: each configuration runs in a fresh subprocess. On CPU it resets the kernel's peak-RSS counter
(`/proc/self/clear_refs` = 5) after loading the model, paging its weights in with a 16-token forward and building
the input, runs one forward, and reads VmHWM:
peak = VmHWM - RSS before the forward, i.e. what the forward itself allocated at its high point (weights
excluded). On CUDA it uses torch.cuda.max_memory_allocated over the same window. Two measurements at the longest T:
- the whole model's forward: source eager, converted chunked (512) and converted unchunked (chunk 0);
- one attention call alone (SmolLM2's shapes: 9 query heads, 3 K/V heads, head_dim 64, causal mask),
  chunked vs unchunked: the "peak attention memory".
Targets (issue 3): time <= 1.5x the source's eager attention at T=1024; chunked peak <= 0.5x unchunked at T=2048.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _status_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load(folder: Path, attn: str | None, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": attn} if attn else {"trust_remote_code": True}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).to(device).eval()


def input_ids(folder: Path, length: int, device: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    from surgery.data import pydoc_texts, token_stream

    ids = token_stream(pydoc_texts(), AutoTokenizer.from_pretrained(folder), length)
    return ids[:length].view(1, length).to(device)


# --- time ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def time_forwards(models: dict, ids: torch.Tensor, repeats: int, device: str) -> dict[str, tuple[float, float]]:
    """name -> (median wall seconds, median CPU seconds of this process) of one forward."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            _sync(device)
            wall, cpu = time.perf_counter(), time.process_time()
            model(ids, logits_to_keep=1, use_cache=False)
            _sync(device)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for name, t in times.items()}


# --- memory (run in a child process) ------------------------------------------------------------------------------
def _peak_of(fn, device: str) -> float:
    """MiB that `fn()` allocates at its high point (see the module docstring)."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kb("VmRSS")
    fn()
    return (_status_kb("VmHWM") - before) / 1024


def child(spec: dict) -> None:
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if spec["what"] == "model":
        model = load(Path(spec["folder"]), spec["attn"], device, dtype)
        if spec["chunk"] is not None:
            model.set_talking_heads_chunk_size(spec["chunk"])
        ids = input_ids(Path(spec["tokenizer"]), spec["length"], device)
        with torch.no_grad():
            model(ids[:, :16])  # page the weights in (loading may map them lazily), so they are not counted
            peak = _peak_of(lambda: model(ids, logits_to_keep=1, use_cache=False), device)
    else:
        import types

        from surgery.talking_heads.modeling_talking_heads import TalkingHeadsMixing, talking_heads_attention

        h, kv, d, t = 9, 3, 64, spec["length"]
        mixer = TalkingHeadsMixing(dict(heads=h, head_dim=d, logits_mixing=True, weights_mixing=True, heads_logits=h,
                                        heads_weights=h, pair_rotary_dims=True, chunk_size=spec["chunk"])).to(device, dtype)
        module = types.SimpleNamespace(talking_heads=mixer, training=False, is_causal=True)
        gen = torch.Generator(device).manual_seed(0)
        q = torch.randn(1, h, t, d, generator=gen, device=device, dtype=dtype)
        k, v = (torch.randn(1, kv, t, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
        mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None, None]
        with torch.no_grad():
            peak = _peak_of(lambda: talking_heads_attention(module, q, k, v, mask, scaling=d**-0.5), device)
    print(json.dumps({"peak_mib": peak}))


def measure(spec: dict) -> float:
    # Every allocation over 64 KiB gets its own mapping, unmapped when freed: RSS follows the live tensors instead
    # of what glibc keeps cached in its heap (with the default, adaptive threshold the peak depends on history).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         cwd=REPO, timeout=1200, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"memory child failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])["peak_mib"]


# --- main ------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default).")
    parser.add_argument("--converted", type=Path, help="An existing talking-heads conversion of smollm2 (else made).")
    parser.add_argument("--memory-only", action="store_true", help="Skip the timings.")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

    from surgery.checkpoint.source import resolve_source
    from surgery.talking_heads import convert_to_talking_heads
    from surgery.talking_heads.options import TalkingHeadsOptions

    device = args.device
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    source = resolve_source("smollm2").folder
    with tempfile.TemporaryDirectory() as tmp:
        converted = args.converted
        if converted is None:
            converted = Path(tmp) / "smollm2-th"
            convert_to_talking_heads(resolve_source("smollm2"), converted, TalkingHeadsOptions(chunk_size=args.chunk_size),
                                     progress=False)
        if args.threads:
            torch.set_num_threads(args.threads)
        print(f"SmolLM2-135M, {device} {dtype}, {torch.get_num_threads()} threads, batch 1; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        if not args.memory_only:
            report_times(source, converted, args, device, dtype)
        report_memory(source, converted, args, device, dtype)


def report_times(source: Path, converted: Path, args, device: str, dtype: str) -> None:
    models = {
        "eager": load(source, "eager", device, getattr(torch, dtype)),
        "sdpa": load(source, "sdpa", device, getattr(torch, dtype)),
        "talking-heads": load(converted, None, device, getattr(torch, dtype)),
    }
    models["talking-heads"].set_talking_heads_chunk_size(args.chunk_size)
    print(f"\nforward time, median of {args.repeats} (TH: talking-heads, chunks of {args.chunk_size})")
    print(f"{'':>6} {'wall-clock seconds':^38} | {'CPU seconds (this process)':^38}")
    print(f"{'T':>6}" + f" {'eager':>8} {'sdpa':>8} {'TH':>8} {'TH/eag':>6} {'TH/sdp':>6} |" * 2)
    with torch.no_grad():  # warm-up: pages the weights in, initializes the kernels
        for model in models.values():
            model(input_ids(source, min(args.lengths), device), logits_to_keep=1, use_cache=False)
    for length in args.lengths:
        t = time_forwards(models, input_ids(source, length, device), args.repeats, device)
        row = f"{length:>6}"
        for i in (0, 1):
            eager, sdpa, th = t["eager"][i], t["sdpa"][i], t["talking-heads"][i]
            row += f" {eager:>8.3f} {sdpa:>8.3f} {th:>8.3f} {th / eager:>6.2f} {th / sdpa:>6.2f} |"
        print(row)
    print(f"(load average now {os.getloadavg()[0]:.1f})")


def report_memory(source: Path, converted: Path, args, device: str, dtype: str) -> None:
    length = max(args.lengths)
    base = dict(device=device, dtype=dtype, length=length, tokenizer=str(source), threads=args.threads)
    eager = measure(base | dict(what="model", folder=str(source), attn="eager", chunk=None))
    chunked = measure(base | dict(what="model", folder=str(converted), attn=None, chunk=args.chunk_size))
    unchunked = measure(base | dict(what="model", folder=str(converted), attn=None, chunk=0))
    print(f"\npeak memory of one forward at T={length} (MiB above the loaded model):")
    print(f"  source, eager attention            {eager:>9.1f}")
    print(f"  talking-heads, chunks of {args.chunk_size:<4}       {chunked:>9.1f}  "
          f"({chunked / eager:.2f}x eager, {chunked / unchunked:.2f}x unchunked)")
    print(f"  talking-heads, unchunked           {unchunked:>9.1f}  ({unchunked / eager:.2f}x eager)")
    attn_chunked = measure(base | dict(what="attention", chunk=args.chunk_size))
    attn_unchunked = measure(base | dict(what="attention", chunk=0))
    print(f"peak memory of one attention call at T={length} (9 heads, 3 K/V heads, head_dim 64, causal):")
    print(f"  chunks of {args.chunk_size:<4} {attn_chunked:>9.1f}   unchunked {attn_unchunked:>9.1f}   "
          f"ratio {attn_chunked / attn_unchunked:.2f}x (target <= 0.5x)")


if __name__ == "__main__":
    main()
