"""The model card (README.md) of a converted checkpoint: hub metadata and what was done to the model.

Everything comes from the folder itself (config.json, surgery.json, uptrain.png), the source folder when it is
still on disk (for `surgery.inspect` ratios and its licence), and `surgery check --json` reports. The metadata is
huggingface_hub's `ModelCardData` (base model and relation, datasets, the check reports' numbers as `model-index`
`EvalResult`s) and the card a `ModelCard`, so the hub's own parser reads what it writes; the body is assembled here
(not through ModelCard's Jinja templates, which would evaluate `{{ }}` inside a report's untrusted text).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from ..errors import SurgeryError
from ..inspection import inspect_checkpoint
from ..units import si_number
from ..kinds import find_kind
from ..checkpoint.record import local_source_folder, public_data, public_record
from .runtimes import runs_in_section, vllm_serves
from .validate import Validation

# Cards carrying this line were written by `surgery push` and are rewritten by the next push; others are kept.
MARKER = "<!-- model card written by `surgery push`: delete this line to keep your edits -->"
EMBEDDED = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
SAMPLE_CHARS = 120  # a generation sample is cut to this many characters in the card
SAMPLES_SHOWN = 2  # samples per report in the card

# Text from reports and records (names of texts, generations, a stranger's surgery.json) is data: in the card it is
# escaped so that it renders as the characters it holds. HTML's specials and the table separator become entities
# (GFM splits table rows on raw `|` only), Markdown's punctuation is backslash-escaped (no emphasis, link, image,
# heading or code span can open), and line breaks become spaces (a cell, or a line of prose, stays one line).
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "&#124;"}
_MARKDOWN = set("\\`*_[#~")  # an unopened `]` is plain text


def text(value: object, limit: int | None = None) -> str:
    """`value` as literal characters in Markdown prose or a table cell (see above); cut to `limit` characters."""
    raw = " ".join(str(value).split())
    if limit is not None and len(raw) > limit:
        raw = raw[:limit - 1] + "…"
    return "".join(_ENTITIES.get(c) or (f"\\{c}" if c in _MARKDOWN else c) for c in raw)


def code(value: object) -> str:
    """`value` as an inline code span: no backtick or line break inside can end it, and nothing in it is HTML."""
    return "`" + " ".join(str(value).split()).replace("`", "'") + "`"


def number(value: object, fmt: str = "", suffix: str = "") -> str:
    """A report's number formatted for the card; anything else (missing, a string in a hand-edited report) as "-"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return format(value, fmt) + suffix


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
    loaded = src.get("loaded")  # a model the API saved: "hub", "folder" or "memory"
    base = EMBEDDED.get(spec) if loaded is None else None
    if (loaded in (None, "hub") and spec and spec.count("/") == 1 and not Path(spec).exists()
            and not spec.startswith((".", "/", "~"))):
        base = spec  # a hub id
    meta = _front_matter(folder / "README.md") if folder else {}
    license_ = meta.get("license") or _gguf_license(((record or {}).get("local") or {}).get("gguf_path") or src.get("gguf_file"))
    if license_ is None and folder is not None:
        license_ = json.loads((folder / "config.json").read_text()).get("license") if (folder / "config.json").exists() else None
    return {"base_model": base, "license": license_, "folder": folder, "spec": spec, "revision": src.get("revision"),
            "loaded": loaded}


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


def plain(value: object, limit: int = 200) -> str:
    """Untrusted text for a metadata field: escaped as in the body (`text`: whoever renders the whole file as
    Markdown, front matter included, meets no tag, link or table cell from a report), one line, cut to `limit`."""
    return text(value, limit)


def hub_datasets(record: dict, reports: list[tuple[str, dict]] = ()) -> list[str]:
    """The hub datasets (`owner/name`) the model was calibrated, uptrained and checked on, in order of first use;
    local files, pydoc and the offline fallback name none."""
    from ..data import hub_dataset_id

    def part(key: str) -> dict:
        return record.get(key) if isinstance(record.get(key), dict) else {}

    up = part("uptraining")
    specs: list = [part("calibration").get("data"), *(up.get("data") if isinstance(up.get("data"), list)
                                                      else [up.get("data")]), up.get("eval_data")]
    for _, report in reports:
        specs += [report.get("data")] + [t.get("data") for t in report.get("texts") or [] if isinstance(t, dict)]
    ids: list[str] = []
    for spec in specs:
        for one in spec.split(" + ") if isinstance(spec, str) else []:
            name = hub_dataset_id(one)
            if name and name not in ids:
                ids.append(name)
    return ids


# A check report's numbers as model-index metrics: (report key, metric type, metric name).
CHECK_METRICS = [("ppl_converted", "perplexity", "perplexity"),
                 ("kl", "kl_divergence", "KL(source || converted) per token"),
                 ("top1_agreement", "top1_agreement", "top-1 agreement with the source")]


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def eval_results(reports: list[tuple[str, dict]]):
    """The check reports as huggingface_hub `EvalResult`s (the card's `model-index`): per checked text, the converted
    model's perplexity, its KL from the source and its top-1 agreement; per lm-eval task, the converted score."""
    from huggingface_hub import EvalResult

    from ..checking.tasks import rows as task_rows
    from ..checkpoint.record import public_data
    from ..data import hub_dataset_id

    out = []
    for name, report in reports:
        texts = [t for t in report.get("texts") or [] if isinstance(t, dict)] or [report]
        for row in texts:
            data = row.get("data") if isinstance(row.get("data"), str) else row.get("text", "?")
            tokens = {"tokens": row["tokens"]} if _finite(row.get("tokens")) else None
            for key, metric, metric_name in CHECK_METRICS:
                if _finite(row.get(key)):
                    out.append(EvalResult(
                        task_type="text-generation", task_name=plain(f"surgery check: {name}"),
                        dataset_type=plain(hub_dataset_id(str(data)) or public_data(str(data))),
                        dataset_name=plain(public_data(str(data))), dataset_args=tokens, metric_type=metric,
                        metric_name=metric_name,
                        metric_value=float(row[key])))
        if isinstance(report.get("tasks"), dict):
            for task, metric, _, converted in task_rows(report["tasks"]):
                if _finite(converted):
                    out.append(EvalResult(task_type="text-generation", task_name=plain(task), dataset_type=plain(task),
                                          dataset_name=plain(task), metric_type=plain(metric), metric_name=plain(metric),
                                          metric_value=float(converted)))
    return out


def card_data(v: Validation, info: dict, repo_id: str, reports: list[tuple[str, dict]] = ()):
    """The card's metadata as huggingface_hub's `ModelCardData` (see `metadata`), with the datasets and results."""
    from huggingface_hub import ModelCardData

    results = eval_results(list(reports))
    return ModelCardData(**metadata(v, info), datasets=hub_datasets(v.record or {}, reports) or None,
                         eval_results=results or None, model_name=plain(repo_id.split("/")[-1]) if results else None)


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


def source_words(info: dict) -> str:
    """The source as the card names it: a hub id (with its revision), a local name, or what a loaded model was
    loaded from when it names no checkpoint on the hub (no lineage invented)."""
    if info.get("loaded") == "memory":
        return "a model built in memory (it names no checkpoint: no base model is recorded)"
    if info.get("loaded") == "folder":
        name = f" {code(info['spec'])}" if info["spec"] else ""
        return f"a model loaded from the local folder{name} (not from the hub: no base model is recorded)"
    source = info["base_model"] or info["spec"] or "the source checkpoint"
    return code(source) + (f" (revision {code(info['revision'])})" if info["revision"] else "")


def conversion_section(v: Validation, info: dict) -> list[str]:
    record = v.record or {}
    kind = record.get("kind")
    if not kind:
        return []
    lines = ["## Conversion", ""]
    known = find_kind(record)
    what = known.title if known else kind
    version = f" {text(record['version'])}" if record.get("version") else ""
    lines.append(f"Converted from {source_words(info)} to {text(what)} by `surgery`{version}.")
    gguf = (record.get("source") or {}).get("gguf_file")
    if gguf:
        lines.append(f"The source weights are the GGUF file {code(gguf)} dequantized to float32: they carry that file's "
                     "quantization error, so they are not bit-identical to the original model's release.")
    lines += [text(line) for line in known.card_lines(record)] if known else []
    calibration = record.get("calibration")
    if isinstance(calibration, dict) and isinstance(calibration.get("data"), str):
        lines.append(f"Calibrated on {number(calibration.get('tokens'))} tokens of "
                     f"{text(public_data(calibration['data']))}.")
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
        cell = (lambda x: "-" if x is None else (str(x) if unit is None else si_number(x, unit)))
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
        rows += [(f"{text(name)}: {text_label(t)}", t) for t in texts] if texts else [(text(name), report)]
    for name, r in rows:
        def f(key, fmt):
            return number(r.get(key), fmt)
        top1 = number(100 * r["top1_agreement"], ".2f", "%") if number(r.get("top1_agreement")) != "-" else "-"
        lines.append(f"| {name} | {number(r.get('tokens'))} | {f('max_abs_diff', '.3g')} | {f('kl', '.4g')} | {top1} "
                     f"| {f('ppl_source', '.3f')} | {f('ppl_converted', '.3f')} |")
    lines.append("")
    return lines + positions_section(reports) + generation_section(reports) + tasks_section(reports)


def text_label(row: dict) -> str:
    """A checked text's name in the card: its data as `public_data` names it (a local file by its name only) and the
    tokens read, `pydoc[0:4096]`; escaped (see `text`)."""
    data = row.get("data")
    if isinstance(data, str):
        tokens = row.get("tokens")
        return text(f"{public_data(data)}[0:{tokens}]" if isinstance(tokens, int) else public_data(data))
    return text(public_data(row.get("text", "?")))


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
            lines.append(f"| {text(name)} | {number(a)}-{number(b - 1)} | {number(row['ppl_source'], '.3f')} "
                         f"| {number(row['ppl_converted'], '.3f')} | {number(row['ppl_ratio'], '.3f', 'x')} "
                         f"| {number(row['kl'], '.4g')} | {number(100 * row['top1_agreement'], '.1f', '%')} |")
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
        lines.append(f"| {text(name)} | {number(g['prompts'])} x {number(g['new_tokens'])} "
                     f"| {number(100 * g['token_agreement'], '.1f', '%')} | {number(g['mean_first_divergence'], '.1f')} "
                     f"| {forced} | " + " | ".join(buckets or ["-"] * (len(gen.MARGIN_EDGES) - 1)) + " |")
    return lines + [""] + samples_section(made)


def samples_section(made: list[tuple[str, dict]]) -> list[str]:
    """The first continuations of each report, prompt and both models' text, escaped and cut (`text`)."""
    shown = [(name, s) for name, g in made for s in (g.get("samples") or [])[:SAMPLES_SHOWN] if isinstance(s, dict)]
    if not shown:
        return []
    lines = _table_head("#### Sample continuations", f"The first {SAMPLES_SHOWN} prompts of each report, cut to "
                        f"{SAMPLE_CHARS} characters.", ["report", "prompt", "source", "converted"], [])
    for name, sample in shown:
        lines.append(f"| {text(name)} | " + " | ".join(text(sample.get(k, ""), SAMPLE_CHARS)
                                                      for k in ("prompt", "source", "converted")) + " |")
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
            lines.append(f"| {text(name)} | {text(task)} | {text(metric)} | {number(a, '.4g')} | {number(b, '.4g')} |")
    return lines + [""]


def uptraining_section(v: Validation) -> list[str]:
    up = public_record(v.record or {}).get("uptraining")
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
            value = ", ".join(map(str, up[key])) if isinstance(up[key], list) else up[key]  # a mixture's texts
            lines.append(f"| {title} | {number(value, '.3f') if isinstance(value, float) else text(value)} |")
    for source in up.get("sources") or []:  # a streamed run: each source's weight and share of the windows
        share = source.get("share") if isinstance(source, dict) else None
        if isinstance(share, (int, float)):
            lines.append(f"| data {text(source.get('data'))} | weight {text(source.get('weight'))}, {share:.1%} of the windows |")
    opt = up.get("optimizer") or {}
    if isinstance(opt, dict) and opt:
        lines.append(f"| optimizer | {text(opt.get('name', ''))} lr {text(opt.get('lr'))} "
                     f"({text(opt.get('schedule', ''))}) |")
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
    elif is_causal_lm(v.config) and vllm_serves(v.record, v.config):
        lines.append("A standard architecture: no custom code, and vLLM serves it as is "
                     f"(`vllm serve {repo_id}`; see \"Where it runs\" for how that is known).")
    elif is_causal_lm(v.config):
        lines.append("A standard architecture: no custom code (for vLLM, see \"Where it runs\").")
    lines.append("")
    return lines


def bench_section(bench: dict | None) -> list[str]:
    """The measured speed table of a `surgery bench --json` report."""
    if not bench:
        return []
    from ..bench.report import markdown_table

    m = bench.get("machine") if isinstance(bench.get("machine"), dict) else {}
    where = m.get("gpu") or f"{m.get('processor', 'CPU')}, {m.get('threads')} threads"
    flash = bench.get("flash_attn")  # llama.cpp reports: which attention path was measured
    engine = text(bench.get("engine")) + (f", flash attention {text(flash)}" if flash in ("on", "off") else "")
    lines = ["## Measured speed", "",
             f"`surgery bench` ({engine}, {text(bench.get('dtype'))}, {text(where)}, "
             f"{text(str(bench.get('date', ''))[:10])}): medians of {text(bench.get('rounds'))} alternating rounds, "
             f"{text(bench.get('new_tokens'))} generated tokens; ratios are converted / source.", ""]
    rows = [r | {"batch": number(r.get("batch")), "context": number(r.get("context"))}
            for r in bench.get("results") or [] if isinstance(r, dict)]  # the table's only text cells
    return lines + markdown_table(bench | {"results": rows}) + [""]


def build_card(v: Validation, repo_id: str, reports: list[tuple[str, dict]] = (), bench: dict | None = None) -> str:
    from huggingface_hub import ModelCard

    info = source_info(v.record)
    data = card_data(v, info, repo_id, list(reports))
    body = [f"# {text(repo_id.split('/')[-1])}", ""]
    body += conversion_section(v, info)
    body += check_section(list(reports))
    body += bench_section(bench)
    body += runs_in_section(v.record, v.config)
    body += uptraining_section(v)
    body += usage_section(v, repo_id)
    body += ["`surgery.json` in this repository records the source (and the sha256 of its files), the conversion "
             "and any uptraining.", ""]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{MARKER}\n\n" + "\n".join(body))  # parsed as the hub will
    return str(card)


def load_reports(paths: list[Path]) -> list[tuple[str, dict]]:
    from ..errors import SurgeryError
    from ..loaders import read_json, validated
    from .reports import CheckReport

    out = []
    for p in paths:
        report = read_json(p, f"check report {p}")
        if not isinstance(report, dict) or "max_abs_diff" not in report:
            raise SurgeryError(f"{p} is not a `surgery check --json` report")
        validated(CheckReport, report, f"check report {p}")
        out.append((Path(p).stem, report))
    return out
