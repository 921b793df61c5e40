"""The aligned merge on interleaved-RoPE families (Cohere, Cohere2, GLM): the family's own rotary pairing against
half-split pairing (what the merge assumed before), and mean pooling; tiny random models, no real checkpoint of these
families is available offline.

    python benchmarks/bench_interleaved_rope.py [--families cohere,cohere2,glm] [--kv-heads 1]

For each family two sources: the tests' tiny random model (4 query heads, 2 K/V heads, hidden 64), and the same model
with K/V head 1 made equal to head 0 up to maps that commute with the family's RoPE (the merge can be exact there).
Held-out text: the first pydoc texts, character-tokenized (8 windows of 128); calibration: 512 tokens of pydoc read
from its end (the default split). Prints mean KL(source || converted) per token and max |delta logits|.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from surgery import arch
from surgery.checkpoint.source import resolve_source
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import GQAOptions
from surgery.testing import tiny_models as tm
from surgery.testing.aligned import aligned, heldout_ids, kl_to_source, rotated_copy_heads
from surgery.testing.tiny_models import tiny


def measure(src: Path, work: Path, family: str, kv: int) -> dict[str, tuple[float, float]]:
    ids = heldout_ids()
    out = {}
    convert_to_kv_heads(resolve_source(str(src)), work / "mean", GQAOptions(kv_heads=kv, force=True), progress=False)
    out["mean pooling"] = kl_to_source(src, work / "mean", ids)
    spec = arch.find_spec(family)
    try:
        arch.register(replace(spec, rotary_pairs="half"))
        aligned(src, work / "half", kv, force=True)
    finally:
        arch.register(spec)
    out["aligned, half-split pairs"] = kl_to_source(src, work / "half", ids)
    aligned(src, work / "own", kv, force=True)
    out[f"aligned, {spec.rotary_pairs} pairs (the family's)"] = kl_to_source(src, work / "own", ids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="cohere,cohere2,glm")
    ap.add_argument("--kv-heads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            for source in ("random", "rotated copies"):
                work = Path(tmp) / f"{family}-{source.replace(' ', '-')}"
                work.mkdir()
                src = work / "src"
                if source == "random":
                    tiny(family, src)
                else:
                    rotated_copy_heads(family, src)
                kv_before = tm.kv_heads_of(tm.load(src).config)
                for method, (kl, diff) in measure(src, work, family, args.kv_heads).items():
                    print(f"{family:8s} {source:15s} {kv_before} -> {args.kv_heads}  {method:38s} "
                          f"KL {kl:.3e}  max|dlogits| {diff:.3e}", flush=True)


if __name__ == "__main__":
    main()
