"""The runtime table (surgery/runs_in.py): every kind has a row, every verified cell names a test that exists and every
read cell a runtime's source file at a version; the exporter refuses what the table says it refuses and maps what
it says llama.cpp runs; a conversion writes its row into surgery.json; `convert`, the model card and the docs say it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from surgery import runs_in
from surgery.errors import SurgeryError
from surgery.testing import tiny_models as tm

REPO = Path(__file__).resolve().parents[1]
SOURCE_FILE = re.compile(r"^[\w.-]+/[\w.-]+:[\w./-]+\.py@[\w.]+$")  # owner/repo:path.py@version


def _wheres(cell) -> list[str]:
    return [w.strip() for w in cell.where.split(";")]


def test_every_kind_has_a_row_and_every_row_a_cell_per_runtime():
    from surgery.kinds import kind_names

    for kind in kind_names():
        assert any(kind in row.kinds for row in runs_in.ROWS), f"the runtime table has no row for {kind}"
    assert runs_in.row_for(None, "qwen3") is not None  # a source: no kind wrote it
    for row in runs_in.ROWS:
        assert set(row.cells) == set(runs_in.RUNTIMES), row.title
        for runtime, cell in row.cells.items():
            assert cell.runs in runs_in.RUNS and cell.how in ("verified", "read"), (row.title, runtime)
            if cell.how == "read":
                assert all(SOURCE_FILE.match(w) for w in _wheres(cell)), (row.title, runtime, cell.where)
    # one row per kind and model_type: no output is answered by two rows
    seen = [(k, t) for row in runs_in.ROWS for k in row.kinds for t in row.model_types or ("*",)]
    assert len(seen) == len(set(seen))


def test_every_verified_cell_names_a_test_that_exists():
    named = {w for row in runs_in.ROWS for cell in row.cells.values() if cell.how == "verified" for w in _wheres(cell)}
    assert named
    for name in sorted(named):
        path, _, test = name.partition("::")
        assert path.startswith("tests/") and test.startswith("test_"), name
        tree = ast.parse((REPO / path).read_text())  # a missing file fails here
        tests = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert test in tests, f"{name}: no such test"


def _example(row) -> dict:
    config = {"num_hidden_layers": 2, **row.example}
    if "swa" in row.kinds:
        config |= {"sliding_window": 8, "use_sliding_window": True,
                   "layer_types": ["sliding_attention", "full_attention"]}
    return config


def test_export_refuses_what_the_table_says_it_refuses():
    """Each row's example config through the exporter's refusals: refused in one line where the llama.cpp cell says
    refused, mapped by one of its GGUF architectures where it says llama.cpp runs it."""
    from surgery.export.plan import module_for, refuse_before_loading

    for row in runs_in.ROWS:
        config, cell = _example(row), row.cells["llama.cpp"]
        if cell.runs == "refused":
            with pytest.raises(SurgeryError) as e:
                refuse_before_loading(config)
            assert len(str(e.value).splitlines()) == 1
        else:
            refuse_before_loading(config)
            assert module_for(config["model_type"]) is not None, row.title


def test_a_conversion_records_its_row_and_convert_says_what_llama_cpp_would_change(tmp_path, cli):
    """swa of a tiny Llama (ministral) and of a tiny Qwen3: surgery.json's runs_in is the table's row for the output's
    model_type; for Qwen3 `convert` says that llama.cpp's own converter would run full attention."""
    for arch in ("llama", "qwen3"):
        src = tm.tiny(arch, tmp_path / arch)
        out = tmp_path / f"{arch}-swa"
        code, stdout, err = cli("convert", src, "--to", "swa", "--window", "4", "--global-layers", "1", "--out", out)
        assert code == 0, err
        record = json.loads((out / "surgery.json").read_text())
        model_type = json.loads((out / "config.json").read_text())["model_type"]
        assert record["runs_in"] == runs_in.record_for("swa", model_type)
        silent = runs_in.silent_changes("swa", model_type)
        if arch == "qwen3":
            assert record["runs_in"]["vllm"]["runs"] == "no" and silent and silent[0] in " ".join(stdout.split())
        else:
            assert model_type == "ministral" and record["runs_in"]["llama.cpp"]["runs"] == "yes"


def test_the_model_card_shows_where_it_runs(tmp_path, cli):
    from surgery.publish.card import build_card
    from surgery.publish.validate import validate_folder

    cards = {}
    for arch in ("llama", "qwen3"):
        src = tm.tiny(arch, tmp_path / arch)
        out = tmp_path / f"{arch}-swa"
        assert cli("convert", src, "--to", "swa", "--window", "4", "--global-layers", "1", "--out", out)[0] == 0
        cards[arch] = build_card(validate_folder(out), f"me/{arch}-swa")
    for arch, card in cards.items():
        assert "## Where it runs" in card
        row = runs_in.row_for("swa", "ministral" if arch == "llama" else "qwen3")
        for cell in row.cells.values():
            assert _wheres(cell)[0] in card
    assert "vllm serve me/llama-swa" in cards["llama"] and "**Caution:**" in cards["llama"]  # own converter
    assert "vllm serve" not in cards["qwen3"]  # the table says vLLM gives its layers no window
    assert "| vLLM | no |" in cards["qwen3"] and "full attention without a warning" in cards["qwen3"]


def test_the_docs_table_is_the_data():
    table = runs_in.markdown_table()
    for row in runs_in.ROWS:
        assert row.title in table
        for cell in row.cells.values():
            assert all(w in table for w in _wheres(cell))
    page = (REPO / "docs" / "reference" / "runtimes.md").read_text()
    assert "<!-- surgery-runs-in: generated by docs/hooks.py from surgery/runs_in.py -->" in page
