"""Long-context `surgery check`: logits a slice of positions at a time (never a whole window's), with the numbers of
the whole-logits check; windows cut from whole documents (which ones qualify, the refusal when none does); the
`stdlib` text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from inprocess import run_cli
from torch.utils._python_dispatch import TorchDispatchMode

from surgery.checking import documents, passes
from surgery.checking.compare import compare_checkpoints, plan_check
from surgery.checking.options import CheckOptions
from surgery.checkpoint.source import resolve_source
from surgery.data import Document, load_texts, pydoc_texts, stdlib_files
from surgery.errors import SurgeryError
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import GQAOptions
from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

METRICS = ("max_abs_diff", "mean_abs_diff", "kl", "top1_agreement", "ppl_source", "ppl_converted")
VOCAB = 96  # the character tokenizer's


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    import transformers as tf

    root = tmp_path_factory.mktemp("check-long")
    torch.manual_seed(3)
    config = tm.ARCHS["llama"]()
    config.intermediate_size = 112  # no activation as wide as the vocabulary but the logits
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / "src")
    char_tokenizer(root / "src")
    convert_to_kv_heads(resolve_source(str(root / "src")), root / "lossy", GQAOptions(kv_heads=2), progress=False)
    return {"src": root / "src", "lossy": root / "lossy"}


def check(models, texts=None, **kwargs) -> dict:
    kwargs = {"tokens": 256, "seq_len": 128, "batch_size": 2, "device": "cpu"} | kwargs
    return compare_checkpoints(resolve_source(str(models["src"])), resolve_source(str(models["lossy"])),
                               pydoc_texts() if texts is None else texts, CheckOptions(**kwargs), progress=False)


def no_projection(monkeypatch, which: str) -> None:
    """Projection.of finds none for the source (`keep`), the converted model, or both: whole logits there."""
    real = passes.Projection.of.__func__

    def of(cls, model, vocab, keep=False):
        return None if which == "both" or (which == "source") == keep else real(cls, model, vocab, keep)

    monkeypatch.setattr(passes.Projection, "of", classmethod(of))


# --- sliced logits: the same numbers ------------------------------------------------------------------------------
@pytest.mark.parametrize("whole", ["both", "source", "converted"])
def test_sliced_logits_give_the_numbers_of_whole_logits(models, monkeypatch, whole):
    sliced = check(models)
    assert sliced["logits"] == "sliced"
    no_projection(monkeypatch, whole)
    reference = check(models)
    assert reference["logits"] == "whole"
    assert sliced["max_abs_diff"] > 0.05  # a real difference to measure
    for key in METRICS:
        assert sliced[key] == pytest.approx(reference[key], rel=1e-6, abs=1e-12), key
    for a, b in zip(sliced["by_position"], reference["by_position"], strict=True):
        assert a["positions"] == b["positions"]
        for key in ("ppl_source", "ppl_converted", "kl", "top1_agreement"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-12), key


@pytest.mark.parametrize("options", [{"dtype": "bfloat16"}, {"precision": "bf16"}], ids=["bf16-weights", "autocast"])
def test_bf16_sliced_logits_are_the_models_own(models, monkeypatch, options):
    """The projection runs in the dtype (and under the autocast) the model's head would: the same bf16 logits."""
    sliced = check(models, **options)
    assert sliced["logits"] == "sliced" and sliced["precision"] == "bf16"
    no_projection(monkeypatch, "both")
    reference = check(models, **options)
    for key in METRICS:
        assert sliced[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-9), key


class LargestVocabRows(TorchDispatchMode):
    """The most rows (positions) of any tensor with a vocabulary-wide last dimension an operation produced."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB:
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


@pytest.mark.parametrize("whole", [False, True], ids=["sliced", "whole-logits"])
def test_no_tensor_of_a_windows_logits_exists(models, monkeypatch, whole):
    """With slices of 100 positions (of 256 per chunk), no operation of either pass makes logits for more positions, and the source
    leaves its hidden states (not logits) for the converted pass; the old whole-logits way fails the same probe."""
    from surgery.checking import compare, spill

    monkeypatch.setattr(passes, "SLICE_BYTES", 100 * VOCAB * 4)
    if whole:
        no_projection(monkeypatch, "both")
    probe, put = LargestVocabRows(), []
    real_put = spill.SpillStore.put
    monkeypatch.setattr(spill.SpillStore, "put", lambda self, key, t: (put.append(tuple(t.shape)),
                                                                      real_put(self, key, t)))
    for name in ("source_pass", "converted_pass"):
        def under_probe(*args, _f=getattr(compare, name), **kw):
            with probe:
                return _f(*args, **kw)
        monkeypatch.setattr(compare, name, under_probe)
    report = check(models, tokens=512, seq_len=128, batch_size=2)
    assert report["windows"] == 4 and put == [(2, 128, VOCAB if whole else 64)] * 2  # hidden size 64
    if whole:
        assert probe.rows >= 2 * 128
    else:
        assert 0 < probe.rows <= 100


# --- windows from whole documents ----------------------------------------------------------------------------------
LONG_A, LONG_B = "a long document about sheep. " * 12, "another long one on goats! " * 6  # 348 and 162 chars
TEXTS = ["short one", LONG_A, "tiny", LONG_B, "x" * 100]


def plan(models, texts, **request):
    request = {"data": "text", "tokens": 1024, "seq_len": 128, "batch_size": 2, "device": "cpu"} | request
    warnings: list[str] = []
    p = plan_check(resolve_source(str(models["src"])), resolve_source(str(models["lossy"])), texts,
                   CheckOptions(**request), warnings.append)
    return p, warnings


def test_whole_documents_give_windows_from_one_document_each(models):
    p, warnings = plan(models, TEXTS, documents="whole")
    ids = [[ord(c) - 31 for c in text] for text in (LONG_A, LONG_B)]  # the character tokenizer: ' ' is 1
    expected = torch.tensor([ids[0][:128], ids[0][128:256], ids[1][:128]])
    assert torch.equal(p.batches, expected)
    d = p.texts[0].documents
    assert d["qualified"] == 2 and d["read"] == 5 and [u["windows"] for u in d["used"]] == [2, 1]
    assert d["used"][0]["document"].startswith("#1: a long document about sheep.")
    assert warnings == ["text: only 3 windows of 128 tokens come from whole documents (2 of its 5 documents are "
                        "that long), not the 8 that --tokens asks for"]


def test_whole_documents_stop_at_the_tokens_asked_for(models):
    p, warnings = plan(models, TEXTS, documents="whole", tokens=256)
    assert p.batches.shape == (2, 128) and p.texts[0].documents["read"] == 2 and not warnings


def test_a_text_too_short_for_the_window_is_one_line_and_writes_nothing(models, capsys, tmp_path):
    for i, text in enumerate(["short one", "x" * 100]):
        (tmp_path / f"{i}.txt").write_text(text)
    out = tmp_path / "report.json"
    code, _, err = run_cli(capsys, "check", str(models["src"]), str(models["lossy"]), "--data",
                           str(tmp_path / "*.txt"), "--documents", "whole", "--seq-len", "128", "--device", "cpu",
                           "--json", str(out))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "no document of" in lines[0] and "128 tokens long" in lines[0] and "longest of the 2 read: 100" in lines[0]
    assert not out.exists()


def test_named_local_files_are_reported_by_name(models, capsys, tmp_path):
    (tmp_path / "a.txt").write_text("short")
    (tmp_path / "b.txt").write_text(LONG_A)
    code, out, err = run_cli(capsys, "check", str(models["src"]), str(models["lossy"]), "--data",
                             str(tmp_path / "*.txt"), "--documents", "whole", "--seq-len", "128", "--tokens", "256",
                             "--device", "cpu", "--json", str(tmp_path / "r.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["documents"]["used"] == [{"document": "b.txt", "tokens": len(LONG_A), "windows": 2}]
    assert "b.txt" in out and report["windows"] == 2


def test_joined_windows_straddling_documents_are_warned_at_a_long_window(models, monkeypatch):
    texts = ["s" * 300] + [f"short document {i}" for i in range(100)]  # EOS after each: the first at position 300
    p, warnings = plan(models, texts, tokens=1024)
    assert p.texts[0].documents == {"mode": "joined", "straddling_windows": 6}  # windows 2..7 of 8
    assert not warnings  # at 128 tokens: no warning
    monkeypatch.setattr(documents, "LONG_WINDOW", 128)
    p, warnings = plan(models, texts, tokens=1024)
    assert len(warnings) == 1 and warnings[0].startswith("6 of the 8 windows of 128 tokens of text hold several")


def test_an_unknown_documents_mode_is_refused():
    from surgery.options import validate_options

    with pytest.raises(SurgeryError, match="^--documents: Input should be 'joined' or 'whole'$"):
        validate_options(CheckOptions, {"documents": "paragraphs"})


def test_stdlib_is_the_standard_librarys_modules_one_document_each():
    files = stdlib_files()
    assert len(files) > 100 and not any("test" in f.parts or "site-packages" in f.parts for f in files)
    first = list(zip(range(3), load_texts("stdlib")))
    for (_, doc), path in zip(first, files):
        assert isinstance(doc, Document) and doc == path.read_text(encoding="utf-8", errors="replace")
        assert path.as_posix().endswith(doc.name)
    assert [d.name for _, d in first] == sorted(d.name for _, d in first)
