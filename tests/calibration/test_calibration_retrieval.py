"""`--calib-retrieval-mix P` (surgery/calibration/retrieval.py): a fraction of the calibration windows replaced by
retrieval examples built from their own text, and the retrieval-head score measured on them; on the tiny pydoc
tokenizer (320 ids: its examples need windows of 1,024) and pydoc's own text."""

from __future__ import annotations

import pytest
import torch

import json

from surgery.calibration.retrieval import head_weights, needle_attention
from surgery.calibration.text import calibration_text
from surgery.errors import SurgeryError
from surgery.retrieval_mix import TASKS
from surgery.testing.pydoc_llama import make_model

WINDOW = 1024


def test_a_mixed_calibration_holds_its_examples_with_the_answers_at_the_end(tokenizer):
    plain = calibration_text("pydoc", tokenizer, 6 * WINDOW, None, window=WINDOW)
    mixed = calibration_text("pydoc", tokenizer, 6 * WINDOW, None, window=WINDOW, retrieval_mix=0.5, seed=3)
    again = calibration_text("pydoc", tokenizer, 6 * WINDOW, None, window=WINDOW, retrieval_mix=0.5, seed=3)
    assert torch.equal(mixed.windows, again.windows) and mixed.windows.shape == plain.windows.shape
    chosen = [p.window for p in mixed.retrieval]
    assert len(chosen) == 3 and plain.retrieval is None and "retrieval_mix" not in plain.record()
    for g in range(6):  # the others are the plain text's windows, untouched
        assert torch.equal(mixed.windows[g], plain.windows[g]) == (g not in chosen)
    for p in mixed.retrieval:
        ids = mixed.windows[p.window].tolist()
        assert p.task in TASKS and p.answers[-1] == WINDOW - 2  # the last position predicts the answer's last token
        answer = ids[p.answers[0] + 1:]
        assert p.needle and max(p.needle) < p.answers[0]  # the needle stands before the question
        needle_tokens = [ids[i] for i in p.needle]
        assert set(needle_tokens) <= set(answer)  # the needle's value tokens are the answer's tokens
        # the haystack is the window's own text: a long stretch of the plain window survives in the example
        plain_ids = plain.windows[p.window].tolist()
        assert any(ids[i:i + 64] == plain_ids[j:j + 64] for i in range(0, 512, 8) for j in range(0, 512))
    record = mixed.record()["retrieval_mix"]
    assert record["fraction"] == 0.5 and record["windows"] == 3 and record["of"] == 6
    assert record["window_indices"] == chosen and record["window_tasks"] == [p.task for p in mixed.retrieval]
    other = calibration_text("pydoc", tokenizer, 6 * WINDOW, None, window=WINDOW, retrieval_mix=0.5, seed=4)
    assert not torch.equal(other.windows, mixed.windows)  # the seed draws


def test_a_bad_fraction_or_too_short_windows_are_refused_in_one_line(tokenizer):
    with pytest.raises(SurgeryError, match=r"--calib-retrieval-mix must lie in \[0, 1\], got 1.5"):
        calibration_text("pydoc", tokenizer, 4096, None, window=WINDOW, retrieval_mix=1.5)
    with pytest.raises(SurgeryError, match=r"--calib-retrieval-mix: --calib-window 256 is too short for .* "
                                           r"--calib-window \d+ is enough"):
        calibration_text("pydoc", tokenizer, 4096, None, window=256, retrieval_mix=0.5)


def test_the_score_is_high_for_a_head_that_looks_at_the_needle_and_low_otherwise():
    g = torch.Generator().manual_seed(0)
    heads, kv, length, d = 4, 2, 64, 16
    needle, answers = [20, 21, 22], list(range(57, 63))
    q = torch.randn(heads, length, d, generator=g) * 0.3
    k = torch.randn(kv, length, d, generator=g) * 0.3
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    k[0, needle] += 4 * u  # the needle's keys of K/V head 0 stand out along u
    q[1, answers] = 8 * u  # query head 1 (on K/V head 0) asks for u at the answer positions: it copies from the needle
    score = needle_attention(q, k, 1.0, None, answers, needle)
    assert score.shape == (heads,) and float(score[1]) > 0.9
    others = score[[0, 2, 3]]
    assert float(others.max()) < 0.2, score  # about the needle's share of the visible keys
    # a head that looks at the needle only after the answer positions (a causal mask) scores nothing there
    assert float(needle_attention(q, k, 1.0, None, [10, 11], needle)[1]) == 0.0
    assert float(needle_attention(q, k, 1.0, 5.0, answers, needle)[1]) > 0.5  # a softcap flattens, still the needle


def test_head_weights_are_one_plus_b_times_the_score():
    scores = torch.tensor([0.1, 0.3, 0.0, 0.4])
    assert head_weights(scores, 0.0) is None and head_weights(None, 2.0) is None
    assert head_weights(torch.zeros(4), 2.0) is None
    w = head_weights(scores, 2.0)
    assert w.dtype == torch.float64 and torch.allclose(w, torch.tensor([1.2, 1.6, 1.0, 1.8], dtype=torch.float64))
    # a layer where no head retrieves keeps weights near 1 (not ~1 + B, as dividing by its mean score would give)
    quiet = head_weights(torch.tensor([0.001, 0.015, 0.004, 0.002]), 4.0)
    assert float(quiet.max()) <= 1 + 4 * 0.015 + 1e-9 and float(quiet.min()) >= 1.0


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, tokenizer):
    """The tiny pydoc Llama with a context of 1,024: room for the retrieval examples."""
    return make_model(tmp_path_factory.mktemp("long-tiny") / "src", tokenizer, positions=WINDOW)


def test_mla_refuses_a_bad_fraction_before_any_work(long_tiny, tmp_path, cli):
    code, _, err = cli("convert", long_tiny, "--to", "mla", "--kv-rank", "16", "--out", tmp_path / "bad",
                       "--calib-retrieval-mix", "-0.1")
    assert code == 2 and "--calib-retrieval-mix must lie in [0, 1], got -0.1" in err and not (tmp_path / "bad").exists()


@pytest.mark.slow  # ~25 s: MLA's query refit on windows of 1,024
def test_mla_calibrates_on_the_mixed_windows(long_tiny, tmp_path, cli):
    src = long_tiny
    code, _, err = cli("convert", src, "--to", "mla", "--kv-rank", "16", "--out", tmp_path / "o", "--calib", "pydoc",
                       "--calib-tokens", 2 * WINDOW, "--calib-window", WINDOW, "--calib-retrieval-mix", "0.5")
    assert code == 0, err
    mix = json.loads((tmp_path / "o" / "surgery.json").read_text())["calibration"]["retrieval_mix"]
    assert mix["fraction"] == 0.5 and mix["windows"] == 1 and mix["of"] == 2
