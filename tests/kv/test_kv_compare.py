"""`compare-merges` prints a table whose headers stay whole in an 80-column terminal and names its text."""

from __future__ import annotations

import io

from rich.console import Console

from surgery.commands.compare_merges import COLUMNS, print_comparison


def test_comparison_table_fits_80_columns():
    rows = [{"method": m, "kv_heads": {"before": 3, "after": 1}, "ppl": p, "kl": 1.2345, "top1_agreement": 0.5912,
             "convert_seconds": 81.4} for m, p in (("mean", 17285.123), ("first", 1940000.5), ("aligned", 27.04))]
    result = {"source": "smollm2", "data": "pydoc", "tokens": 16384, "seq_len": 1024, "ppl_source": 13.283, "rows": rows}
    out = io.StringIO()
    print_comparison(result, Console(file=out, width=80, force_terminal=False))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    header = next(line for line in text.splitlines() if "method" in line and "ppl" in line)
    for name, _ in COLUMNS:
        assert name in header, (name, header)
    assert "1940000.500" in text and "…" not in header
    assert "pydoc[0:16384], windows 1024" in " ".join(text.split())


def test_compare_merges_reports_progress_in_a_log(tmp_path, capsys, monkeypatch):
    from surgery.testing import tiny_models as tm
    from surgery.testing.tiny_models import tiny_tokenizer

    from surgery.commands.compare_merges import compare_merges
    from surgery.checkpoint.source import resolve_source

    monkeypatch.setenv("SURGERY_PROGRESS_SECONDS", "0")
    tm.make_tiny("llama", tmp_path / "src")
    tiny_tokenizer().save_pretrained(tmp_path / "src")
    result = compare_merges(resolve_source(str(tmp_path / "src")), 1, methods=("mean", "first"), tokens=256, seq_len=64,
                            device="cpu")
    assert [r["method"] for r in result["rows"]] == ["mean", "first"]
    err = capsys.readouterr().err
    for method in ("mean", "first"):
        lines = [line for line in err.splitlines() if line.startswith(f"evaluate {method}:")]
        assert lines and lines[-1].startswith(f"evaluate {method}: 256/256 tokens (100%)"), err
