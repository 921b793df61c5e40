"""The kind contract: every registered kind, and a toy kind registered at test time with nothing but its own
module, reaches `surgery convert --help`, `--list`, a recipe, `--dry-run`, the conversion, `surgery inspect`,
`surgery bench` and the model card, and each of them answers with what the kind says (its KV cache, its title)."""

from __future__ import annotations

import json

import pytest
import yaml

from inprocess import run_cli

from surgery.testing import tiny_models as tm


def _toy_kind():
    """A kind written as a contributor would: pools K/V heads like gqa, records itself as "toy", and claims a
    paged runtime (vLLM) caches half of what transformers does (a claim only the kind can make)."""
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import GQAOptions
    from surgery.kinds import Kind, WriteOptions
    from surgery.checkpoint.record import read_record, write_record

    class ToyOptions(WriteOptions):
        pass

    class Toy(Kind):
        def convert(self, source, out, options):
            convert_to_kv_heads(source, out, GQAOptions(kv_heads=2, max_shard_size=options.max_shard_size,
                                                        force=options.force), progress=False)
            record = read_record(out) | {"kind": self.name}
            write_record(out, record)
            return record

        def kv_cache_values(self, shape, config, context=None):
            n = 2 * shape.layers * shape.kv_heads * shape.head_dim
            return {"transformers": n, "vllm": n // 2, "llama.cpp": n}

    return Toy("toy", ToyOptions, title="toy attention (pooled K/V heads)", tags=["toy"], help="toy pools heads.")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract") / "llama"
    return tm.tiny("llama", folder)  # with a tokenizer: a calibrating kind reads text


def _kinds() -> list[str]:
    from surgery.kinds import kind_names

    return [*kind_names(), "toy"]


@pytest.fixture(params=_kinds())
def kind(request, monkeypatch):
    """A registered kind (the toy one registered for the test), with the command line rebuilt from the registry."""
    import surgery.cli as cli
    from surgery.kinds import get_kind, register, unregister

    if request.param == "toy":
        register(_toy_kind())
    monkeypatch.setitem(cli.cli.commands, "convert", cli.convert_command())
    try:
        yield get_kind(request.param)
    finally:
        unregister("toy")


def _flags(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in ("--" + k.replace("_", "-"), str(v))]


def test_every_kind_keeps_the_contract(kind, llama, tmp_path, capsys):
    from surgery.arch import attention_shape
    from surgery.bench.options import BenchOptions
    from surgery.bench.run import run_bench
    from surgery.bench.vllm_engine import kv_bytes_from_config
    from surgery.inspection import inspect_checkpoint
    from surgery.kinds import AttentionShape
    from surgery.publish.card import build_card
    from surgery.publish.validate import validate_folder
    from surgery.recipes import load_recipe
    from surgery.checkpoint.record import read_record

    flags = ["--to", kind.name, *_flags(kind.example_options)]
    code, out, _ = run_cli(capsys, "convert", "--help")
    assert code == 0 and kind.name in out.split("--to [", 1)[1].split("]", 1)[0].split("|")
    code, out, _ = run_cli(capsys, "convert", "--list")
    assert code == 0 and all(f" {label} |" in out.splitlines()[0] for label in kind.support_labels or (kind.name,))

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"source": {"path": str(llama)}, "output": str(tmp_path / "run"),
                                      "steps": [{"convert": {"to": kind.name, **kind.example_options}}]}))
    step = load_recipe(recipe).validated_steps()[0]
    assert step.options.kind is kind

    code, out, err = run_cli(capsys, "convert", llama, *flags, "--dry-run", "--json", "-")
    assert code == 0, err
    assert json.loads(out[out.index("{"):])["kind"] == kind.name

    converted = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", llama, *flags, "--out", converted)
    assert code == 0, err

    config = json.loads((converted / "config.json").read_text())
    s = attention_shape(config)
    shape = AttentionShape(s["layers"], s["heads"], s["kv_heads"], s["head_dim"], s["hidden"])
    stats = inspect_checkpoint(converted)
    assert stats["surgery"] == kind.name
    values = kind.kv_cache_values(shape, config, stats["context"])  # per token, at the context inspect reports
    assert stats["kv_cache_bytes_per_token"] == values["transformers"] * stats["dtype_bytes"]

    tokens = 8  # longer than swa's example window (4): its sliding layer caches only the window
    values = kind.kv_cache_values(shape, config, tokens)
    report = run_bench(BenchOptions(source=str(llama), converted=str(converted), contexts=[tokens], new=1, rounds=1,
                                    device="cpu", threads=1))
    measured = report["results"][0]["rounds"]["converted"][0]["kv_cache_bytes"]
    assert measured == values["transformers"] * tokens * 4  # what transformers really cached, float32
    record = read_record(converted)
    assert kv_bytes_from_config(config, tokens, 2, "vllm", record) == values["vllm"] * tokens * 2

    card = build_card(validate_folder(converted), "me/model")
    assert kind.title in card and all(f"- {tag}" in card for tag in kind.tags)


# ---- modeling code shipped in checkpoints -----------------------------------------------------------------------
def _modeling_functions(path) -> tuple[dict[str, str], str, str]:
    """{function name: its source} of a shipped modeling file, with its kind's names (the class prefix, the module
    stem) to write them generically."""
    import ast

    text = path.read_text()
    tree = ast.parse(text)
    prefix = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", None) == "CLASS_PREFIX")
    functions = {n.name: ast.get_source_segment(text, n) for n in tree.body if isinstance(n, ast.FunctionDef)}
    return functions, prefix, path.stem.removeprefix("modeling_")


def test_the_helpers_modeling_files_share_on_purpose_stay_identical():
    """A converted checkpoint carries one modeling file and must load alone, so each kind's file has its own copy of
    the helpers that make a model class for any transformers architecture: the copies must not drift apart."""
    import ast
    from pathlib import Path

    import surgery

    def code(source: str) -> str:  # the function without its docstring (the kinds' words differ there)
        function = ast.parse(source).body[0]
        if isinstance(function.body[0], ast.Expr) and isinstance(function.body[0].value, ast.Constant):
            function.body = function.body[1:]
        return ast.dump(function)

    files = sorted(Path(surgery.__file__).parent.glob("*/modeling_*.py"))
    assert len(files) >= 2
    generic = []
    for path in files:
        functions, prefix, stem = _modeling_functions(path)
        model_class = functions[f"{stem}_model_class"].replace(prefix, "PREFIX").replace(stem, "KIND")
        generic.append((code(functions["_share_weight_conversions"]), code(model_class)))
    first = generic[0]
    for path, shared in zip(files[1:], generic[1:]):
        assert shared[0] == first[0], f"{path.name}: _share_weight_conversions differs from {files[0].name}'s"
        assert shared[1] == first[1], f"{path.name}: its model_class function differs from {files[0].name}'s"
