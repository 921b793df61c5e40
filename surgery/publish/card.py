"""The model card (README.md) of a converted checkpoint: hub metadata and what was done to the model.

Everything comes from the folder itself (config.json, surgery.json, uptrain.png), the source folder when it is
still on disk (for `surgery.inspect` ratios and its licence), and `surgery check --json` reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..errors import SurgeryError
from ..inspect import _human, inspect_checkpoint
from ..kinds import find_kind
from ..record import local_source_folder
from .validate import Validation

# Cards carrying this line were written by `surgery push` and are rewritten by the next push; others are kept.
MARKER = "<!-- model card written by `surgery push`: delete this line to keep your edits -->"
EMBEDDED = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def _front_matter(readme: Path) -> dict:
    try:
        text = readme.read_text()
    except OSError:
        return {}
    if not text.startswith("---"):
        return {}
    try:
        meta = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _gguf_license(path: str | None) -> str | None:
    if not path or not Path(path).is_file():
        return None
    try:
        import gguf

        field = gguf.GGUFReader(path).fields.get("general.license")
        return str(field.contents()) if field is not None else None
    except Exception:  # a GGUF file we cannot read only loses the licence line
        return None


def source_info(record: dict | None) -> dict:
    """base_model (a hub id when known), license, and the source folder when it still exists."""
    src = (record or {}).get("source") or {}
    spec, folder = src.get("spec"), local_source_folder(record or {})
    base = EMBEDDED.get(spec)
    if base is None and spec and spec.count("/") == 1 and not Path(spec).exists() and not spec.startswith((".", "/", "~")):
        base = spec  # a hub id
    meta = _front_matter(folder / "README.md") if folder else {}
    license_ = meta.get("license") or _gguf_license(((record or {}).get("local") or {}).get("gguf_path") or src.get("gguf_file"))
    if license_ is None and folder is not None:
        license_ = json.loads((folder / "config.json").read_text()).get("license") if (folder / "config.json").exists() else None
    return {"base_model": base, "license": license_, "folder": folder, "spec": spec, "revision": src.get("revision")}


def is_causal_lm(config: dict) -> bool:
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.get("architectures") or [])


def metadata(v: Validation, info: dict) -> dict:
    record = v.record or {}
    kind = find_kind(record)
    tags = ["surgery", *(kind.tags if kind else [])]
    if record.get("uptraining"):
        tags.append("uptrained")
    if v.custom_code:
        tags.append("custom_code")
    meta = {}
    if info["base_model"]:
        meta["base_model"] = info["base_model"]
        meta["base_model_relation"] = "finetune"  # same weights, rewritten attention (and maybe uptrained)
    meta["library_name"] = "transformers"
    if info["license"]:
        meta["license"] = info["license"]
    meta["pipeline_tag"] = "text-generation" if is_causal_lm(v.config) else "feature-extraction"
    meta["tags"] = tags
    return meta


def _ratio(a, b) -> str:
    return f" ({b / a:.2f}x)" if a and b is not None else ""


def _inspect_source(folder) -> dict | None:
    """The source's statistics for the card, when its folder is still there with safetensors weights (pickle
    weights are not read by push: the card then shows the converted model and what surgery.json recorded)."""
    if not folder:
        return None
    try:
        return inspect_checkpoint(folder)
    except SurgeryError:
        return None


def conversion_section(v: Validation, info: dict) -> list[str]:
    record = v.record or {}
    kind = record.get("kind")
    if not kind:
        return []
    lines = ["## Conversion", ""]
    known = find_kind(record)
    what = known.title if known else kind
    source = info["base_model"] or info["spec"] or "the source checkpoint"
    lines.append(f"Converted from `{source}`" + (f" (revision `{info['revision']}`)" if info["revision"] else "")
                 + f" to {what} by `surgery` {record.get('version', '')}.".replace(" .", "."))
    gguf = (record.get("source") or {}).get("gguf_file")
    if gguf:
        lines.append(f"The source weights are the GGUF file `{gguf}` dequantized to float32: they carry that file's "
                     "quantization error, so they are not bit-identical to the original model's release.")
    lines += known.card_lines(record) if known else []
    lines.append("")
    after = inspect_checkpoint(v.folder)
    before = _inspect_source(info["folder"])
    kv = record.get("kv_heads")
    rows = [("query heads", "heads", None), ("K/V heads", "distinct_kv_heads", None), ("parameters", "parameters", ""),
            ("KV cache / token", "kv_cache_bytes_per_token", "B"),
            (f"attention MACs / token @ {after['context']}", "attention_macs_per_token", "")]
    lines += ["| | source | converted |", "|---|---:|---:|"]
    for title, key, unit in rows:
        b = before.get(key) if before else None
        if key == "distinct_kv_heads" and b is None and isinstance(kv, dict):
            b = kv.get("before")
        a = after.get(key)
        cell = (lambda x: "-" if x is None else (str(x) if unit is None else _human(x, unit)))
        lines.append(f"| {title} | {cell(b)} | {cell(a)}{_ratio(b, a) if unit is not None else ''} |")
    if before is None:
        lines += ["", "(The source folder was not available when this card was written: source columns are partial.)"]
    lines.append("")
    return lines


def _table_head(title: str, intro: str, text_columns: list[str], number_columns: list[str]) -> list[str]:
    """A section's title, one line saying what it shows, and a markdown table's header (numbers right-aligned)."""
    columns = text_columns + number_columns
    return [title, "", intro, "", "| " + " | ".join(columns) + " |",
            "|" + "|".join(["---"] * len(text_columns) + ["---:"] * len(number_columns)) + "|"]


def check_section(reports: list[tuple[str, dict]]) -> list[str]:
    if not reports:
        return []
    lines = _table_head("## Check against the source", "Same tokens through both models (`surgery check`).",
                        ["report"], ["tokens", "max abs Δ", "KL / token", "top-1 agreement", "ppl source",
                                     "ppl converted"])
    rows = []
    for name, report in reports:  # a check on several texts: a row per text
        texts = [t for t in report.get("texts") or [] if isinstance(t, dict)]
        rows += [(f"{name}: {t.get('text', '?')}", t) for t in texts] if texts else [(name, report)]
    for name, r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if isinstance(r.get(key), (int, float)) else "-"
        top1 = f"{100 * r['top1_agreement']:.2f}%" if isinstance(r.get("top1_agreement"), (int, float)) else "-"
        lines.append(f"| {name} | {r.get('tokens', '-')} | {f('max_abs_diff', '.3g')} | {f('kl', '.4g')} | {top1} "
                     f"| {f('ppl_source', '.3f')} | {f('ppl_converted', '.3f')} |")
    lines.append("")
    return lines + positions_section(reports) + generation_section(reports) + tasks_section(reports)


def positions_section(reports: list[tuple[str, dict]]) -> list[str]:
    """Perplexity by position in the window, for reports that have it (`check` with windows over 64 tokens)."""
    split = [(name, r) for name, r in reports if r.get("by_position")]
    if not split:
        return []
    lines = _table_head("### By position in the window",
                        "Where in the context the conversion costs (positions a-b of each window of the check).",
                        ["report", "positions"], ["ppl source", "ppl converted", "ratio", "KL / token",
                                                  "top-1 agreement"])
    for name, r in split:
        for row in r["by_position"]:
            a, b = row["positions"]
            lines.append(f"| {name} | {a}-{b - 1} | {row['ppl_source']:.3f} | {row['ppl_converted']:.3f} "
                         f"| {row['ppl_ratio']:.3f}x | {row['kl']:.4g} | {100 * row['top1_agreement']:.1f}% |")
    return lines + [""]


def generation_section(reports: list[tuple[str, dict]]) -> list[str]:
    """Greedy continuations of reports made with `check --generate`: agreement, and forced agreement by the source's
    margin (surgery/checking/generate.py)."""
    from ..checking import generate as gen

    made = [(name, r["generation"]) for name, r in reports if isinstance(r.get("generation"), dict)]
    if not made:
        return []
    lines = _table_head("### Greedy continuations",
                        "Both models continue the same prompts greedily (`surgery check --generate`); forced: the "
                        "converted model's argmax on the source's own continuation, by the source's top-1 minus "
                        "top-2 probability at that step.",
                        ["report"], ["prompts x tokens", "token agreement", "first divergence", "forced agreement"]
                        + [f"forced, margin {lo:g}-{hi:g}" for lo, hi in zip(gen.MARGIN_EDGES, gen.MARGIN_EDGES[1:])])
    for name, g in made:
        buckets = [f"{100 * b['agreement']:.1f}% of {b['steps']}" if b.get("agreement") is not None else "-"
                   for b in g.get("forced_by_margin", [])]
        forced = f"{100 * g['forced_agreement']:.1f}%" if "forced_agreement" in g else "-"
        lines.append(f"| {name} | {g['prompts']} x {g['new_tokens']} | {100 * g['token_agreement']:.1f}% "
                     f"| {g['mean_first_divergence']:.1f} | {forced} | "
                     + " | ".join(buckets or ["-"] * (len(gen.MARGIN_EDGES) - 1)) + " |")
    return lines + [""]


def tasks_section(reports: list[tuple[str, dict]]) -> list[str]:
    """The lm-eval scores of reports made with `check --tasks`."""
    from ..checking.tasks import rows

    scored = [(name, r) for name, r in reports if isinstance(r.get("tasks"), dict) and r["tasks"]]
    if not scored:
        return []
    lines = _table_head("### lm-eval tasks", "Both models scored by lm-evaluation-harness (`surgery check --tasks`).",
                        ["report", "task", "metric"], ["source", "converted"])
    for name, r in scored:
        for task, metric, a, b in rows(r["tasks"]):
            lines.append(f"| {name} | {task} | {metric} | {a:.4g} | {b:.4g} |")
    return lines + [""]


def uptraining_section(v: Validation) -> list[str]:
    up = (v.record or {}).get("uptraining")
    if not up:
        return []
    lines = ["## Uptraining", ""]
    keys = [("data", "data"), ("tokens", "tokens"), ("steps", "steps"), ("loss", "loss"), ("teacher", "teacher"),
            ("trained parameters", "train"), ("sequence length", "seq_len"), ("tokens / step", "batch_tokens"),
            ("held-out perplexity before", "initial_eval_ppl"), ("held-out perplexity after", "final_eval_ppl"),
            ("teacher's held-out perplexity", "teacher_eval_ppl"), ("second held-out text (--eval-data)", "eval_data"),
            ("its perplexity before", "initial_other_eval_ppl"), ("its perplexity after", "final_other_eval_ppl"),
            ("the teacher's on it", "teacher_other_eval_ppl"), ("training seconds", "train_seconds")]
    lines += ["| | |", "|---|---|"]
    for title, key in keys:
        if up.get(key) is not None:
            value = up[key]
            lines.append(f"| {title} | {f'{value:.3f}' if isinstance(value, float) else value} |")
    for source in up.get("sources") or []:  # a streamed run: each source's weight and share of the windows
        share = source.get("share") if isinstance(source, dict) else None
        if isinstance(share, (int, float)):
            lines.append(f"| data {source.get('data')} | weight {source.get('weight')}, {share:.1%} of the windows |")
    opt = up.get("optimizer") or {}
    if opt:
        lines.append(f"| optimizer | {opt.get('name', '')} lr {opt.get('lr')} ({opt.get('schedule', '')}) |")
    if (v.folder / "uptrain.png").exists():
        lines += ["", "![uptraining loss and perplexity](uptrain.png)"]
    lines.append("")
    return lines


def usage_section(v: Validation, repo_id: str) -> list[str]:
    auto = "AutoModelForCausalLM" if is_causal_lm(v.config) else "AutoModel"
    trust = ", trust_remote_code=True" if v.custom_code else ""
    lines = ["## How to load", "", "```python", f"from transformers import {auto}, AutoTokenizer", "",
             f'model = {auto}.from_pretrained("{repo_id}"{trust})',
             f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}"{trust})', "```", ""]
    if v.custom_code:
        lines.append("The attention is implemented by the modeling code shipped in this repository "
                     f"({', '.join(f'`{c}`' for c in v.code_files)}), hence `trust_remote_code=True`. The tokenizer "
                     "is a standard one: the flag on its line only keeps transformers, which reads the model's "
                     "configuration on the way, from stopping to ask about that code.")
    elif is_causal_lm(v.config):
        lines.append("A standard architecture: no custom code, and vLLM serves it as is "
                     f"(`vllm serve {repo_id}`).")
    lines.append("")
    return lines


def bench_section(bench: dict | None) -> list[str]:
    """The measured speed table of a `surgery bench --json` report."""
    if not bench:
        return []
    from ..bench import markdown_table

    m = bench.get("machine", {})
    where = m.get("gpu") or f"{m.get('processor', 'CPU')}, {m.get('threads')} threads"
    lines = ["## Measured speed", "",
             f"`surgery bench` ({bench.get('engine')}, {bench.get('dtype')}, {where}, {bench.get('date', '')[:10]}): "
             f"medians of {bench.get('rounds')} alternating rounds, {bench.get('new_tokens')} generated tokens; "
             "ratios are converted / source.", ""]
    return lines + markdown_table(bench) + [""]


def build_card(v: Validation, repo_id: str, reports: list[tuple[str, dict]] = (), bench: dict | None = None) -> str:
    info = source_info(v.record)
    meta = metadata(v, info)
    body = [f"# {repo_id.split('/')[-1]}", ""]
    body += conversion_section(v, info)
    body += check_section(list(reports))
    body += bench_section(bench)
    body += uptraining_section(v)
    body += usage_section(v, repo_id)
    body += ["`surgery.json` in this repository records the source (and the sha256 of its files), the conversion "
             "and any uptraining.", ""]
    return ("---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n" + MARKER + "\n\n"
            + "\n".join(body))


def load_reports(paths: list[Path]) -> list[tuple[str, dict]]:
    from ..errors import SurgeryError

    out = []
    for p in paths:
        try:
            report = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            raise SurgeryError(f"check report {p} cannot be read: {str(e).splitlines()[0]}") from None
        if not isinstance(report, dict) or "max_abs_diff" not in report:
            raise SurgeryError(f"{p} is not a `surgery check --json` report")
        out.append((Path(p).stem, report))
    return out
