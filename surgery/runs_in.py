"""Where each output of this toolkit runs with the function it was converted to: one row per kind and family, one
cell per runtime (transformers, llama.cpp through `surgery export --gguf`, vLLM), and nothing taken on trust. Every
cell says how it is known:
- verified: a test of this repository shows it (named `tests/PATH.py::test_name`; tests/test_runs_in.py checks that
  every named test exists);
- read: the runtime's own source file says so (named as `owner/repo:path@commit`, the version read), not run here.
Where a runtime would silently compute something else than the output's function (llama.cpp's own converter on a
Qwen2/Qwen3 `swa` output: full attention, no warning), the row says so in `silent`.

Held here as data, below the kinds (it names them, it does not import them): a conversion writes its row into
surgery.json (`record_for`, "runs_in"), `surgery convert` and `surgery export` say the silent changes, the model card
renders it (surgery/publish/runtimes.py) and so does docs/reference/runtimes.md (`markdown_table`, through
docs/hooks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

RUNTIMES = ("transformers", "llama.cpp", "vllm")
RUNTIME_TITLES = {"transformers": "transformers", "llama.cpp": "llama.cpp via `surgery export`", "vllm": "vLLM"}
SOURCE = "source"  # the row key of a checkpoint no kind wrote
# what a cell's `runs` says: the runtime computes the output's function; it does not (or computes something else);
# `surgery export` refuses it in one line (nothing written)
RUNS = ("yes", "no", "refused")

# the sources read, at the versions read
VLLM_REGISTRY = "vllm-project/vllm:vllm/model_executor/models/registry.py@0002bff"
VLLM_TRANSFORMERS_BASE = "vllm-project/vllm:vllm/model_executor/models/transformers/base.py@810fb5d"
VLLM_SINKS = "vllm-project/vllm:vllm/model_executor/models/transformers/fusers/sink.py@41fc00d"
VLLM_QWEN2 = "vllm-project/vllm:vllm/model_executor/models/qwen2.py@cb24295"
VLLM_QWEN3 = "vllm-project/vllm:vllm/model_executor/models/qwen3.py@002456d"
VLLM_GEMMA2 = "vllm-project/vllm:vllm/model_executor/models/gemma2.py@025adfb"
TRANSFORMERS_SMOLLM3 = "huggingface/transformers:src/transformers/models/smollm3/modeling_smollm3.py@v5.24"

# the tests that verify cells
T_KV = "tests/kv/test_kv_convert.py::test_mqa_mean_pooling_matches_independent_recompute"
T_SWA = "tests/swa/test_swa.py::test_the_output_loads_without_code_and_is_exact_within_the_window"
T_SINKS = "tests/swa/test_swa.py::test_sinks_are_a_standard_granite_swa_exact_until_trained_then_trained_alone"
T_MLA = "tests/mla/test_mla.py::test_output_is_a_plain_dense_deepseek_v3"
T_TALKING = "tests/talking_heads/test_talking_heads.py::test_converted_model_computes_the_source_function"
T_SWITCH = "tests/switchhead/test_switchhead.py::test_one_expert_per_head_reproduces_the_source"
T_LLAMA_CPP_TINY = "tests/export/test_export_llama_cpp.py::test_tiny_kinds_compute_the_same_logits_in_llama_cpp"
T_LLAMA_CPP_SMOLLM2 = "tests/export/test_export_llama_cpp.py::test_smollm2_kinds_in_llama_cpp_at_2048_tokens"
T_LLAMA_CPP_QWEN = "tests/export/test_export_qwen.py::test_qwen_files_compute_the_same_logits_in_llama_cpp"
T_HYBRID = "tests/hybrid/test_hybrid.py::test_every_layer_kept_computes_the_source_function_as_a_standard_bamba"
T_LLAMA_CPP_HYBRID = "tests/export/test_export_hybrid.py::test_hybrid_computes_the_same_logits_in_llama_cpp"
T_LLAMA_CPP_HYBRID_SMOLLM2 = "tests/export/test_export_hybrid.py::test_smollm2_hybrid_in_llama_cpp_at_2048_tokens"
T_EXPORT_REFUSALS = "tests/test_runs_in.py::test_export_refuses_what_the_table_says_it_refuses"


@dataclass(frozen=True)
class Cell:
    runs: str  # one of RUNS
    how: str  # "verified" (where: tests, ";"-separated) or "read" (where: the runtime's source files)
    where: str
    note: str = ""

    def as_dict(self) -> dict:
        return {"runs": self.runs, "how": self.how, "where": self.where, **({"note": self.note} if self.note else {})}


def verified(runs: str, tests: str, note: str = "") -> Cell:
    return Cell(runs, "verified", tests, note)


def read(runs: str, sources: str, note: str = "") -> Cell:
    return Cell(runs, "read", sources, note)


@dataclass(frozen=True)
class Row:
    kinds: tuple[str, ...]  # the kinds whose outputs this row covers (SOURCE: a checkpoint no kind wrote)
    model_types: tuple[str, ...]  # the output config's model_type; (): any the kinds' other rows do not name
    families: str  # the row's families, in words
    cells: dict[str, Cell]
    silent: tuple[str, ...] = ()  # where a runtime would silently compute something else, and what
    example: dict = field(default_factory=dict)  # a config of the row (tests/test_runs_in.py runs the exporter on it)

    @property
    def title(self) -> str:
        return f"{', '.join(self.kinds)}: {self.families}"


EXPORTED_BY_TESTS = "export in llama.cpp: logits within 1e-3 of transformers' at every position"
OWN_CONVERTER_FULL = ("llama.cpp's own converter (convert_hf_to_gguf.py) writes it as full attention without a warning "
                      "(the source's function, measured on Qwen3 with llama-cpp-python 0.3.36, issue 54), and "
                      "`surgery export` refuses it: serve it with transformers")
OWN_CONVERTER_MINISTRAL = ("llama.cpp's own converter refuses ministral (`Model MinistralForCausalLM is not supported`); "
                           "relabelled as Mistral it converts without the window and llama.cpp computes the source "
                           "(measured with llama-cpp-python 0.3.36, issue 54): use `surgery export`")

ROWS: tuple[Row, ...] = (
    Row((SOURCE, "mqa", "gqa"), ("llama", "mistral"), "Llama and Mistral bodies", {
        "transformers": verified("yes", T_KV, "loads with plain from_pretrained"),
        "llama.cpp": verified("yes", f"{T_LLAMA_CPP_SMOLLM2}; {T_LLAMA_CPP_TINY}",
                              "arch llama; SmolLM2's source and MQA output at 2,048 tokens"),
        "vllm": read("yes", VLLM_REGISTRY, "LlamaForCausalLM and MistralForCausalLM map to llama.py"),
    }, example={"model_type": "llama"}),
    Row((SOURCE, "mqa", "gqa"), ("qwen2", "qwen3"), "Qwen2 and Qwen3 bodies", {
        "transformers": verified("yes", T_KV, "loads with plain from_pretrained"),
        "llama.cpp": verified("yes", T_LLAMA_CPP_QWEN,
                              "arch qwen2 (q/k/v biases) and qwen3 (q/k norms), NEOX RoPE; tiny sources and their "
                              "MQA outputs; a sliding window that bites is refused"),
        "vllm": read("yes", VLLM_REGISTRY, "Qwen2ForCausalLM and Qwen3ForCausalLM map to qwen2.py and qwen3.py"),
    }, example={"model_type": "qwen2"}),
    Row((SOURCE, "mqa", "gqa"), (), "other families (Gemma, Phi-3, GPT-2, ...)", {
        "transformers": verified("yes", T_KV, "every family of surgery/testing/tiny_models.py, plain from_pretrained"),
        "llama.cpp": verified("refused", T_EXPORT_REFUSALS,
                              "the exporter maps Llama, Mistral, Qwen2 and Qwen3 bodies and MLA outputs only"),
        "vllm": read("yes", VLLM_REGISTRY, "the registry maps each family's class to its own module (VLLM_CLASSES); "
                                           "not checked further"),
    }, example={"model_type": "gemma"}),
    Row(("swa",), ("ministral",), "Llama and Mistral bodies (ministral)", {
        "transformers": verified("yes", T_SWA),
        "llama.cpp": verified("yes", f"{T_LLAMA_CPP_SMOLLM2}; {T_LLAMA_CPP_TINY}",
                              "arch granite_swa: the window pattern per layer, beyond the window included"),
        "vllm": read("yes", f"{VLLM_REGISTRY}; {VLLM_TRANSFORMERS_BASE}",
                     "not in the registry: vLLM falls back to its Transformers backend, which gives each sliding "
                     "layer its window from layer_types; not run here"),
    }, silent=(OWN_CONVERTER_MINISTRAL,), example={"model_type": "ministral"}),
    Row(("swa",), ("granite_swa",), "Llama and Mistral bodies with sinks (`--sinks`, granite_swa)", {
        "transformers": verified("yes", T_SINKS),
        "llama.cpp": verified("yes", T_LLAMA_CPP_TINY, "arch granite_swa, trained sinks and multipliers carried"),
        "vllm": read("yes", f"{VLLM_REGISTRY}; {VLLM_TRANSFORMERS_BASE}; {VLLM_SINKS}",
                     "the Transformers backend: per-layer windows, and the sinks handed to vLLM's attention by a "
                     "later version's sink fuser; not run here"),
    }, example={"model_type": "granite_swa"}),
    Row(("swa",), ("qwen2", "qwen3"), "Qwen2, Qwen3", {
        "transformers": verified("yes", T_SWA),
        "llama.cpp": verified("refused", T_EXPORT_REFUSALS, "no GGUF architecture the exporter writes carries "
                                                            "these layers with a per-layer window"),
        "vllm": read("no", f"{VLLM_QWEN2}; {VLLM_QWEN3}",
                     "no layer gets its own window (Attention without per_layer_sliding_window), and Qwen2Model "
                     "raises 'Sliding window for some but all layers is not supported' when a window is configured"),
    }, silent=(OWN_CONVERTER_FULL,), example={"model_type": "qwen3"}),
    Row(("swa",), ("smollm3",), "SmolLM3", {
        "transformers": read("yes", TRANSFORMERS_SMOLLM3, "a layer slides where use_sliding_window is set and "
                                                          "layer_types says so"),
        "llama.cpp": verified("refused", T_EXPORT_REFUSALS),
        "vllm": read("yes", f"{VLLM_REGISTRY}; {VLLM_TRANSFORMERS_BASE}",
                     "SmolLM3ForCausalLM runs on the Transformers backend, which gives each sliding layer its "
                     "window; not run here"),
    }, silent=(OWN_CONVERTER_FULL,), example={"model_type": "smollm3"}),
    Row(("swa",), ("gemma2",), "Gemma 2", {
        "transformers": verified("yes", T_SWA),
        "llama.cpp": verified("refused", T_EXPORT_REFUSALS),
        "vllm": read("no", VLLM_GEMMA2, "global attention on every layer at the version read (its FIXME: 'vLLM "
                                        "currently ignores it'); later versions not read"),
    }, example={"model_type": "gemma2"}),
    Row(("mla",), ("deepseek_v3",), "any family MLA converts (output deepseek_v3)", {
        "transformers": verified("yes", T_MLA),
        "llama.cpp": verified("yes", f"{T_LLAMA_CPP_SMOLLM2}; {T_LLAMA_CPP_TINY}",
                              "arch deepseek2, absorbed: llama.cpp caches the latent and the rope key only"),
        "vllm": read("yes", VLLM_REGISTRY, "DeepseekV3ForCausalLM maps to deepseek_v2.py"),
    }, example={"model_type": "deepseek_v3"}),
    Row(("hybrid",), ("bamba",), "Llama and Mistral bodies (output bamba)", {
        "transformers": verified("yes", T_HYBRID, "plain from_pretrained; the torch path on CPU"),
        "llama.cpp": verified("yes", f"{T_LLAMA_CPP_HYBRID_SMOLLM2}; {T_LLAMA_CPP_HYBRID}",
                              "arch granitehybrid; SmolLM2's output at 2,048 tokens; each mixer padded with zero "
                              "heads to the inner size llama.cpp takes (2 x hidden): the same function, twice the "
                              "mixer state in llama.cpp"),
        "vllm": read("yes", VLLM_REGISTRY, "BambaForCausalLM maps to bamba.py; whether it takes one B/C group per "
                                           "head and full rotary was not read; not run here"),
    }, example={"model_type": "bamba"}),
    Row(("talking-heads", "switchhead"), (), "any family (the output ships its own modeling code)", {
        "transformers": verified("yes", f"{T_TALKING}; {T_SWITCH}", "with trust_remote_code=True"),
        "llama.cpp": verified("refused", T_EXPORT_REFUSALS, "custom code: no llama.cpp architecture computes it"),
        "vllm": read("no", VLLM_REGISTRY, "a class outside the registry runs only on the Transformers backend, and "
                                          "only when it declares itself backend-compatible, which this modeling "
                                          "code does not"),
    }, example={"model_type": "talking_heads_llama", "auto_map": {"AutoModelForCausalLM": "m.M"}}),
)

# vLLM's class and module for each family's output, as read in VLLM_REGISTRY (absent: not in the registry, so the
# Transformers backend when transformers' class is backend-compatible)
VLLM_CLASSES = {
    "llama": "LlamaForCausalLM -> llama.py", "mistral": "MistralForCausalLM -> llama.py",
    "mixtral": "MixtralForCausalLM -> mixtral.py", "qwen2": "Qwen2ForCausalLM -> qwen2.py",
    "qwen2_moe": "Qwen2MoeForCausalLM -> qwen2_moe.py", "qwen3": "Qwen3ForCausalLM -> qwen3.py",
    "qwen3_moe": "Qwen3MoeForCausalLM -> qwen3_moe.py", "gemma": "GemmaForCausalLM -> gemma.py",
    "gemma2": "Gemma2ForCausalLM -> gemma2.py", "gemma3_text": "Gemma3ForCausalLM -> gemma3.py",
    "olmo": "OlmoForCausalLM -> olmo.py", "olmo2": "Olmo2ForCausalLM -> olmo2.py", "olmoe": "OlmoeForCausalLM -> olmoe.py",
    "smollm3": "SmolLM3ForCausalLM -> the Transformers backend", "phi": "PhiForCausalLM -> phi.py",
    "stablelm": "StableLmForCausalLM -> stablelm.py", "starcoder2": "Starcoder2ForCausalLM -> starcoder2.py",
    "granite": "GraniteForCausalLM -> granite.py", "cohere": "CohereForCausalLM -> commandr.py",
    "cohere2": "Cohere2ForCausalLM -> commandr.py", "glm": "GlmForCausalLM -> glm.py",
    "exaone4": "Exaone4ForCausalLM -> exaone4.py", "arcee": "ArceeForCausalLM -> arcee.py",
    "apertus": "ApertusForCausalLM -> apertus.py", "phi3": "Phi3ForCausalLM -> phi3.py",
    "gpt_neox": "GPTNeoXForCausalLM -> gpt_neox.py", "gpt2": "GPT2LMHeadModel -> gpt2.py",
    "gpt_bigcode": "GPTBigCodeForCausalLM -> gpt_bigcode.py", "falcon": "FalconForCausalLM -> falcon.py",
    "deepseek_v3": "DeepseekV3ForCausalLM -> deepseek_v2.py",
}


def row_for(kind: str | None, model_type: str | None) -> Row | None:
    """The row of an output of `kind` (None: a checkpoint no kind wrote) whose config has `model_type`: the kind's
    row naming the model_type, else its row for any other; None when the table has no row for the kind."""
    kind = kind or SOURCE
    rows = [r for r in ROWS if kind in r.kinds]
    return (next((r for r in rows if model_type in r.model_types), None)
            or next((r for r in rows if not r.model_types), None))


def record_for(kind: str | None, model_type: str | None) -> dict | None:
    """surgery.json's "runs_in": the row's cells for this output (and vLLM's class for its model_type, as read)."""
    row = row_for(kind, model_type)
    if row is None:
        return None
    cells = {runtime: row.cells[runtime].as_dict() for runtime in RUNTIMES}
    if model_type in VLLM_CLASSES:
        cells["vllm"]["class"] = VLLM_CLASSES[model_type]
    return {"row": row.title, "table": "docs/reference/runtimes.md", **cells,
            **({"silent": list(row.silent)} if row.silent else {})}


def silent_changes(kind: str | None, model_type: str | None) -> tuple[str, ...]:
    """What a runtime would silently change for this output (the lines `convert`, `export` and the card say)."""
    row = row_for(kind, model_type)
    return row.silent if row else ()


def swa_llama_cpp_note(target_model_type: str | None) -> str:
    """What llama.cpp does with an swa output of this model type, in one clause (surgery/swa/kind.py's summary and
    card line): from the row's llama.cpp cell and its silent changes."""
    row = row_for("swa", target_model_type)
    if row is None or target_model_type not in row.model_types:
        return "llama.cpp: `surgery export` refuses it; llama.cpp's own converter was not checked on it"
    if row.cells["llama.cpp"].runs == "yes":
        kept = "window, per-layer pattern and sinks" if target_model_type == "granite_swa" else \
            "window and per-layer pattern"
        own = " (llama.cpp's own converter refuses ministral)" if target_model_type == "ministral" else ""
        return f"in llama.cpp: `surgery export OUT --gguf FILE` writes it as granite_swa, {kept} kept{own}"
    if row.silent:
        return row.silent[0]
    return "llama.cpp: `surgery export` refuses it; llama.cpp's own converter was not checked on it"


def cell_text(cell: Cell) -> str:
    """One cell in markdown: the verdict, how it is known, where, and the note."""
    verdict = {"yes": "yes", "no": "**no**", "refused": "refused by `surgery export`"}[cell.runs]
    where = "; ".join(f"`{w.strip()}`" for w in cell.where.split(";"))
    return f"{verdict} ({cell.how}: {where}{'; ' + cell.note if cell.note else ''})"


def markdown_table() -> str:
    """The table of docs/reference/runtimes.md: one row per ROWS entry, then the silent changes."""
    lines = ["| kinds: families | output model_type | " + " | ".join(RUNTIME_TITLES[r] for r in RUNTIMES) + " |",
             "|---|---|" + "---|" * len(RUNTIMES)]
    for row in ROWS:
        types = ", ".join(f"`{t}`" for t in row.model_types) or "any other"
        lines.append(f"| {row.title} | {types} | " + " | ".join(cell_text(row.cells[r]) for r in RUNTIMES) + " |")
    silent = [(row, s) for row in ROWS for s in row.silent]
    if silent:
        lines += ["", "Where a runtime would silently compute something else:", ""]
        lines += [f"- {row.title}: {s}." for row, s in silent]
    return "\n".join(lines)
