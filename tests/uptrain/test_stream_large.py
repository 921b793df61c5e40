"""Large and single-file corpora (issue 40): a .txt file is read lazily by paragraph (or line, or file), a long
document is tokenized in pieces as the windows need them, so a reader's memory does not grow with the file or the
document; a one-file corpus gives a held-out split; an empty or too small streamed source is refused before the
model loads and leaves no run folder."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from surgery.data import MAX_TXT_CHARS, txt_documents
from surgery.training import UptrainOptions, uptrain
from inprocess import uptrain_error
from surgery.testing.pydoc_llama import FAST

REPO = Path(__file__).resolve().parents[2]


def stream_error(monkeypatch, capsys, *args) -> str:
    return uptrain_error(monkeypatch, capsys, *args, warnings=True)


def pydoc_paragraphs() -> list[str]:
    from surgery.data import pydoc_texts

    return [p for t in pydoc_texts() for p in t.split("\n\n") if p.strip()]


def test_txt_documents_are_paragraphs_lines_or_the_file_and_never_longer_than_the_bound(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a b\nc\n\n\nd e\n\nf")
    assert list(txt_documents(str(path), "paragraph")) == ["a b\nc\n", "d e\n", "f"]
    assert list(txt_documents(str(path), "line")) == ["a b\n", "c\n", "\n", "\n", "d e\n", "\n", "f"]
    assert list(txt_documents(str(path), "file")) == ["a b\nc\n\n\nd e\n\nf"]
    big = tmp_path / "big.txt"
    big.write_text("x" * (2 * MAX_TXT_CHARS + 5))  # one line, no blank line: cut, nothing lost
    docs = list(txt_documents(str(big), "paragraph"))
    assert [len(d) for d in docs] == [MAX_TXT_CHARS, MAX_TXT_CHARS, 5]


PEAK = textwrap.dedent("""
    import json, resource, sys
    from surgery.testing.pydoc_llama import make_tokenizer
    from surgery.training.stream_held_out import hold_out
    from surgery.training.stream_readers import Reader
    from surgery.training.stream_sources import Plan, resolve_sources
    tok = make_tokenizer()
    sources = resolve_sources([sys.argv[1]], [1.0])
    args = dict(tokenizer=tok, eos=tok.eos_token_id, seq_len=64, seed=0, readers=1, epochs=1)
    _, held = hold_out(args, sources, 256)
    reader = iter(Reader(Plan(sources=tuple(sources), held=held, **args), 0, None))
    first = [next(reader)[0][:8].tolist() for _ in range(int(sys.argv[2]))]
    print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "first": first[:2]}))
""")


def peak(path: Path, windows: int = 200) -> dict:
    done = subprocess.run([sys.executable, "-c", PEAK, str(path), str(windows)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def sparse_txt(path: Path, size: int) -> Path:
    """Real paragraphs, then a sparse tail of NULs up to `size` bytes (no disk used for it)."""
    with open(path, "w") as f:
        f.write("\n\n".join(pydoc_paragraphs()[:400]) + "\n\n")
        f.truncate(size)
    return path


def test_a_huge_txt_file_streams_with_memory_independent_of_its_size(tmp_path):
    small = peak(sparse_txt(tmp_path / "small.txt", 32 << 20))
    huge = peak(sparse_txt(tmp_path / "huge.txt", 8 << 30))  # 8 GiB: read whole, it would not fit beside the tests
    assert huge["first"] == small["first"]  # the same documents in the same order
    assert huge["peak_mb"] < small["peak_mb"] + 64, (small, huge)


def test_a_long_jsonl_document_is_tokenized_in_pieces(tmp_path):
    words = " ".join(pydoc_paragraphs())
    def one_line(name, chars):
        text = (words * (chars // len(words) + 1))[:chars]
        path = tmp_path / name
        rows = [words[:4000], text, "tail"]  # the first document is held out (--eval-tokens 256)
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
        return path
    short, long = peak(one_line("short.jsonl", 1 << 20), 50), peak(one_line("long.jsonl", 12 << 20), 50)
    assert long["first"] == short["first"]
    # the long line itself is held (as text, by datasets): about 3 x 11 MB more; tokenized whole it was gigabytes
    assert long["peak_mb"] < short["peak_mb"] + 150, (short, long)


RUN = dict(FAST, loss="lm", batch_tokens=128, micro_batch=2, tokens=128 * 3, eval_every=0)


@pytest.mark.parametrize("mode", ["packed", "stream"])
def test_a_one_file_corpus_trains_with_a_held_out_split(tiny, tmp_path, mode):
    one = tmp_path / "one.txt"
    one.write_text("\n\n".join(pydoc_paragraphs()[:600]))
    report = uptrain(UptrainOptions(model=str(tiny), out=tmp_path / "o", **(RUN | dict(
        data=[str(one)], eval_tokens=512, data_mode=mode))))
    assert (tmp_path / "o" / "model.safetensors").exists()
    assert report["initial_eval_ppl"] > report["final_eval_ppl"] > 1  # measured on the held-out paragraphs
    record = json.loads((tmp_path / "o" / "surgery.json").read_text())
    assert record["uptraining"]["txt_unit"] == "paragraph"



def test_an_empty_or_too_small_streamed_source_leaves_no_run_folder(tiny, tmp_path, monkeypatch, capsys):
    from surgery.training import model_io

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(model_io, "load_causal_lm", no_model)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "a single document"}) + "\n")
    out = ["--out", tmp_path / "o", "--seq-len", "64", "--batch-tokens", "64", "--micro-batch", "1", "--eval-tokens",
           "0", "--tokens", "640", "--data-mode", "stream"]
    assert "holds no text" in stream_error(monkeypatch, capsys, tiny, "--data", empty, *out)
    assert "too few documents" in stream_error(monkeypatch, capsys, tiny, "--data", one, "--data-workers", "2", *out)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()
