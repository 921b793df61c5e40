"""SwitchHead zero-shot quality: which conversion choice costs what (issue 15 §3).

Converts SOURCE to SwitchHead once per VARIANT and measures each with `surgery check`'s metrics (perplexity, KL
per token, top-1 agreement against the source) on check's default held-out text: pydoc's first `--tokens` tokens
in windows of 1,024. The calibration reads pydoc's last documents, never these (the converter's policy).

Variants (comma-separated; one variant is one or more of these names joined by '+', e.g. k1+medoid):
  k2             the default: H=3 E=3, top-2 experts, clusters inside the source's K/V groups, the members' mean
                 query/key, output refit
  k1, k3         top-1 / top-3 (every expert) instead of top-2, with the same attention patterns
  free           clusters across K/V groups (respect_kv_groups=False): heads grouped by attention maps alone, the
                 key the members' mean K head
  medoid         the medoid member's query/key instead of the members' mean
  norefit        the members' own output projections (no output refit)
  srcin          every layer calibrated on the source's own hidden states (calib_inputs="source") instead of the
                 converted layers' outputs

    python benchmarks/bench_switchhead_quality.py --variants k2,srcin,k1 --work DIR --json R
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from surgery.checking.compare import compare_checkpoints  # noqa: E402
from surgery.checking.options import CheckOptions  # noqa: E402
from surgery.data import pydoc_texts  # noqa: E402
from surgery.checkpoint.source import resolve_source  # noqa: E402
from surgery.switchhead import convert_to_switchhead  # noqa: E402
from surgery.switchhead.options import SwitchHeadOptions  # noqa: E402

OPTIONS = {"k2": {}, "k1": {"topk": 1}, "k3": {"topk": 3}, "free": {"respect_kv_groups": False},
           "medoid": {"qk_merge": "medoid"},
           "norefit": {"refit": False}, "srcin": {"calib_inputs": "source"}}
ABLATIONS = ("respect_kv_groups", "qk_merge", "refit", "calib_inputs")  # convert_to_switchhead's own arguments


def variant_options(spec: str) -> dict:
    options = {"heads": 3, "experts": 3, "topk": 2}
    for part in spec.split("+"):
        if part not in OPTIONS:
            sys.exit(f"unknown variant part {part!r}; choose from {', '.join(OPTIONS)}")
        options |= OPTIONS[part]
    return options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="smollm2")
    p.add_argument("--variants", default="k2,k3,free")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens (pydoc's first)")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    src = resolve_source(a.source)
    rows = {}
    for spec in a.variants.split(","):
        out, options = a.work / f"sh-{spec}", variant_options(spec)
        start = time.time()
        if not (out / "surgery.json").exists():
            ablations = {k: options.pop(k) for k in ABLATIONS if k in options}
            kind_options = SwitchHeadOptions(calib=["pydoc"], calib_tokens=a.calib_tokens, force=True, **options)
            convert_to_switchhead(src, out, kind_options, progress=False, **ablations)
        seconds = time.time() - start
        report = compare_checkpoints(src, resolve_source(str(out)), pydoc_texts(),
                                     CheckOptions(tokens=a.tokens, trust_remote_code=True), progress=False)
        m = {key: report[key] for key in ("ppl_source", "ppl_converted", "kl", "top1_agreement")}
        m["ratio"] = m["ppl_converted"] / m["ppl_source"]
        rows[spec] = {"options": options, "convert_seconds": round(seconds, 1), **m}
        print(f"{spec}: perplexity {m['ppl_converted']:.2f} vs the source's {m['ppl_source']:.2f} = {m['ratio']:.2f}x, "
              f"KL {m['kl']:.3f}, top-1 {m['top1_agreement']:.1%} (conversion {seconds:.0f} s)", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"source": a.source, "text": f"pydoc[0:{a.tokens}] (tokens), windows of 1024",
                                      "calib_tokens": a.calib_tokens, "variants": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
