"""The report of `check --retrieval`: Wilson intervals for every cell (table, JSON, plot), lengths in multiples of
the converted model's window."""

from __future__ import annotations

import io

import pytest

from surgery.checking.retrieval import RetrievalPlan
from surgery.checking.retrieval_spec import parse_lengths, resolve_lengths
from surgery.checking.retrieval_report import (cell_text, compare_retrieval_scores, paired_gap, plot, print_table,
                                               t975, wilson)
from surgery.errors import SurgeryError


@pytest.mark.parametrize("hits, n, low, high", [
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
    (29, 29, 0.8830, 1.0),  # Newcombe (1998), Statistics in Medicine 17:857, table I, the score method
    (17, 20, 0.6396, 0.9476), (8, 20, 0.2188, 0.6134),
])
def test_wilson_matches_published_intervals(hits, n, low, high):
    assert wilson(hits, n) == pytest.approx((low, high), abs=5e-5)


def test_wilson_narrows_with_trials_and_refuses_nonsense():
    widths = [(lambda lo, hi: hi - lo)(*wilson(n // 2, n)) for n in (4, 20, 100)]
    assert widths == sorted(widths, reverse=True)
    assert wilson(1, 4, z=2.576)[0] < wilson(1, 4)[0]  # 99% is wider than 95%
    for side in (0, 1):  # a fractional hit (a share of items) lies between its whole neighbours
        assert wilson(2, 5)[side] < wilson(2.5, 5)[side] < wilson(3, 5)[side]
    for hits, n in ((1, 0), (5, 4), (-1, 4)):
        with pytest.raises(ValueError):
            wilson(hits, n)


def _rows(task: str, length: int, scores: list[float], items: int = 1) -> list[dict]:
    return [{"task": task, "length": length, "depth": (i + 0.5) / len(scores), "score": s, "items": items,
             "logprob": -s} for i, s in enumerate(scores)]


def _plan(tasks, lengths, samples, window=None) -> RetrievalPlan:
    plan = RetrievalPlan.of(tasks, lengths, samples, "noise", [])
    plan.window = window
    return plan


def test_every_cell_has_its_counts_and_interval_and_the_mean_pools_the_tasks():
    source = _rows("passkey", 512, [1.0] * 17 + [0.0] * 3) + _rows("variable_tracking", 512, [0.6, 0.4] * 10, 5)
    converted = _rows("passkey", 512, [1.0] * 8 + [0.0] * 12) + _rows("variable_tracking", 512, [0.2, 0.0] * 10, 5)
    report = compare_retrieval_scores(_plan(["passkey", "variable_tracking"], [512], 20, window=256), source, converted)
    passkey = report["accuracy"]["passkey"]["512"]
    assert passkey["n"] == 20 and passkey["hits_source"] == 17 and passkey["hits_converted"] == 8
    assert (passkey["ci_low_source"], passkey["ci_high_source"]) == pytest.approx(wilson(17, 20))
    assert cell_text(passkey) == "85% [64-95] / 40% [22-61]"
    chain = report["accuracy"]["variable_tracking"]["512"]  # shares of 5 items: fractional hits over 20 examples
    assert chain["source"] == pytest.approx(0.5) and chain["hits_source"] == pytest.approx(10.0)
    assert chain["items"] == 100 and chain["items_source"] == 50 and chain["items_converted"] == 10
    assert (chain["ci_low_converted"], chain["ci_high_converted"]) == pytest.approx(wilson(2.0, 20))
    mean = report["mean"]["512"]
    assert mean["n"] == 40 and mean["hits_source"] == pytest.approx(27.0)
    assert (mean["ci_low_source"], mean["ci_high_source"]) == pytest.approx(wilson(27.0, 40))
    assert report["window"] == 256 and report["lengths_in_windows"] == [2.0] and "Wilson" in report["interval"]


def test_the_table_prints_each_cell_with_its_interval_and_the_plot_shades_them():
    from rich.console import Console

    source = _rows("passkey", 512, [1.0] * 17 + [0.0] * 3) + _rows("passkey", 1024, [1.0] * 20)
    converted = _rows("passkey", 512, [1.0] * 8 + [0.0] * 12) + _rows("passkey", 1024, [0.0] * 20)
    report = compare_retrieval_scores(_plan(["passkey"], [512, 1024], 20, window=256), source, converted)
    out = io.StringIO()
    print_table(report, Console(file=out, width=240))
    text = out.getvalue()
    assert "85% [64-95] / 40% [22-61]" in text and "100% [84-100] / 0% [0-16]" in text
    assert "(2w)" in text and "(4w)" in text and "w = 256 tokens" in text
    assert plot(report)[:4] == b"\x89PNG"


def test_hits_by_needle_depth_show_where_the_converted_model_loses_its_needles():
    from rich.console import Console

    source = _rows("niah_single", 2048, [1.0] * 18)
    converted = _rows("niah_single", 2048, [0.0, 1.0] * 3 + [1.0] * 11 + [0.0])  # misses far back, and one near
    report = compare_retrieval_scores(_plan(["niah_single"], [2048], 18, window=256), source, converted)
    bins = report["by_depth"]["niah_single"]["2048"]
    assert [b["depth"] for b in bins] == [[0.0, 0.3333], [0.3333, 0.6667], [0.6667, 1.0]]
    assert [(b["n"], b["hits_source"], b["hits_converted"]) for b in bins] == [(6, 6, 3), (6, 6, 6), (6, 6, 5)]
    out = io.StringIO()
    print_table(report, Console(file=out, width=240))
    assert "niah_single @ 2048 (8w)" in out.getvalue() and "6/6 / 3/6" in out.getvalue()


def test_lengths_in_windows_resolve_against_the_window():
    assert parse_lengths("2w,4w,8w") == ("2w", "4w", "8w") and parse_lengths("512, 4w,") == (512, "4w")
    assert parse_lengths("w,0.5w") == ("w", "0.5w") and parse_lengths((512, "2W")) == (512, "2w")
    assert parse_lengths(None) is None and parse_lengths("") is None
    assert resolve_lengths(parse_lengths("512,4w,2w,w"), 256) == [256, 512, 1024]
    assert resolve_lengths(parse_lengths("1.5w"), 100) == [150]
    for bad in ("3x", "2ww", "-4w", "4 w k", "w2", ","):
        with pytest.raises(SurgeryError, match="--retrieval-lengths takes comma-separated token counts or multiples"):
            parse_lengths(bad)
    with pytest.raises(SurgeryError, match="w is the converted model's sliding window, and m has no sliding window"):
        resolve_lengths(parse_lengths("512,2w"), None, "m has no sliding window")


def test_t_quantiles_match_the_published_table_and_the_expansion_joins_it():
    # Student (1908) / Fisher & Yates' table, two-sided 95%: 12.706 at 1, 2.093 at 19, 2.021 at 40, 1.984 at 100
    assert (t975(1), t975(19)) == (12.706, 2.093)
    assert t975(40) == pytest.approx(2.0211, abs=2e-4) and t975(100) == pytest.approx(1.9840, abs=2e-4)
    assert t975(31) < t975(30) and abs(t975(31) - 2.0395) < 2e-4  # the expansion continues the table
    with pytest.raises(ValueError):
        t975(0)


def test_the_paired_log_prob_gap_uses_the_same_examples_and_its_t_interval():
    from rich.console import Console

    source = _rows("niah_single", 2048, [1.0] * 4)
    converted = [dict(r, logprob=r["logprob"] + d) for r, d in zip(source, (-0.2, -0.4, -0.6, -0.8))]
    mean, low, high = paired_gap(source, converted)
    half = 3.182 * (0.2581989 / 2)  # t at 3 dof times the differences' sd over sqrt(4)
    assert (mean, low, high) == pytest.approx((-0.5, -0.5 - half, -0.5 + half), abs=1e-5)
    assert paired_gap(source[:1], converted[:1]) is None  # one example has no spread
    with pytest.raises(ValueError, match="rows do not pair"):
        paired_gap(source, converted[::-1])
    with pytest.raises(ValueError, match="differ in number"):
        paired_gap(source, converted[:3])
    shuffled = compare_retrieval_scores(_plan(["niah_single"], [2048], 4), source, converted[::-1])
    assert "logprob_gap" not in shuffled["accuracy"]["niah_single"]["2048"]  # rows that do not pair: no gap, no error
    report = compare_retrieval_scores(_plan(["niah_single"], [2048], 4, window=256), source, converted)
    cell = report["accuracy"]["niah_single"]["2048"]
    assert (cell["logprob_gap"], cell["logprob_gap_low"], cell["logprob_gap_high"]) == pytest.approx((mean, low, high))
    assert report["mean"]["2048"]["logprob_gap"] == pytest.approx(-0.5) and "Student t" in report["logprob_gap"]
    out = io.StringIO()
    print_table(report, Console(file=out, width=240))
    assert f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]" in out.getvalue()
