"""SwitchHead vs its source: forward (prefill) time, per-token decode time and KV-cache memory, as ratios measured
in one run on the same machine.

    python benchmarks/bench_switchhead.py                        # SmolLM2-135M -> H=3, E=3, k=2 (converted here)
    python benchmarks/bench_switchhead.py --converted DIR        # an existing SwitchHead checkpoint of --source
    python benchmarks/bench_switchhead.py --lengths 1024 2048 --repeats 3 --device cuda

For each sequence length T: one batch of T random tokens; prefill = a forward pass that fills a fresh KV cache
(median of --repeats after a warm-up); decode = the mean time of --decode single-token steps after it; KV cache
= the bytes of the key and value tensors the cache holds after the prefill. Both models run in float32 with the
same attention implementation (sdpa).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


from surgery.inspection import inspect_checkpoint  # noqa: E402
from surgery.runtime import cache_keyword, returned_cache  # noqa: E402
from surgery.checkpoint.source import resolve_source  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def measure(model, length: int, repeats: int, decode: int, device: torch.device, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
    next_ids = torch.randint(0, vocab, (1, decode), generator=gen).to(device)
    times, out = [], None
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        sync(device)
        if i:  # the first run is a warm-up
            times.append(time.perf_counter() - start)
    cache, keyword = returned_cache(out), cache_keyword(model)
    kv = cache_bytes(cache)
    steps = []
    for j in range(decode):
        sync(device)
        start = time.perf_counter()
        model(input_ids=next_ids[:, j : j + 1], use_cache=True, **{keyword: cache})
        sync(device)
        steps.append(time.perf_counter() - start)
    return {"prefill_s": statistics.median(times), "decode_s_per_token": statistics.mean(steps) if steps else None,
            "kv_cache_bytes": kv}


def load(folder: Path, device: torch.device, remote: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                 trust_remote_code=remote)
    return model.to(device).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--converted", type=Path, help="SwitchHead checkpoint of --source (default: convert now)")
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens when converting here")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode", type=int, default=16, help="single-token decode steps after the prefill")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    source = resolve_source(args.source)
    tmp = None
    converted = args.converted
    if converted is None:
        from surgery.switchhead import convert_to_switchhead
        from surgery.switchhead.options import SwitchHeadOptions

        tmp = tempfile.TemporaryDirectory(prefix="bench-switchhead-")
        converted = Path(tmp.name) / "switchhead"
        options = SwitchHeadOptions(heads=args.heads, experts=args.experts, topk=args.topk, calib=["pydoc"],
                                    calib_tokens=args.calib_tokens)
        convert_to_switchhead(source, converted, options, progress=False)
    sh = json.loads((converted / "config.json").read_text())["switchhead"]
    models = {"source": load(source.folder, device, False), "switchhead": load(converted, device, True)}
    vocab = models["source"].config.vocab_size
    print(f"device {device}, threads {torch.get_num_threads()}, source {args.source}, SwitchHead "
          f"H={sh['heads']} E={sh['experts']} k={sh['topk']} (from h={sh['source_heads']}, "
          f"{sh['source_kv_heads']} K/V heads)")
    results = {"device": str(device), "threads": torch.get_num_threads(), "switchhead": sh, "lengths": {}}
    header = f"{'T':>6} {'model':>11} {'prefill s':>10} {'decode ms/tok':>14} {'KV cache MiB':>13}"
    print(header)
    for length in args.lengths:
        row = {}
        for name, model in models.items():  # interleaved per length: both see the same machine state
            row[name] = measure(model, length, args.repeats, args.decode, device, vocab)
            r = row[name]
            decode = f"{1000 * r['decode_s_per_token']:.1f}" if r["decode_s_per_token"] else "-"
            print(f"{length:>6} {name:>11} {r['prefill_s']:>10.3f} {decode:>14} {r['kv_cache_bytes'] / 2**20:>13.2f}")
        ratio = {key: row["switchhead"][key] / row["source"][key] for key in row["source"] if row["source"][key]}
        row["ratio"] = ratio
        print(f"{length:>6} {'ratio':>11} {ratio['prefill_s']:>10.3f} {ratio.get('decode_s_per_token', 0):>14.3f} "
              f"{ratio['kv_cache_bytes']:>13.3f}")
        results["lengths"][length] = row
    a, b = inspect_checkpoint(source.folder, context=max(args.lengths)), inspect_checkpoint(converted, context=max(args.lengths))
    results["inspect_ratio"] = {key: b[key] / a[key] for key in ("parameters", "kv_cache_bytes_per_token",
                                                                 "attention_proj_macs_per_token",
                                                                 "attention_macs_per_token")}
    print("inspect (counted, not timed): " + ", ".join(f"{k} {v:.3f}x" for k, v in results["inspect_ratio"].items())
          + f" at context {max(args.lengths)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
