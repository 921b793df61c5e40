"""`--retrieval-mix P` (surgery/training/retrieval_mix.py): a fraction of the training windows replaced by retrieval
examples built from their own text, the same in `surgery teacher` and `surgery uptrain`; on the tiny pydoc Llama (320
ids, whose tokenizer needs windows of 1,024 for every task) and pydoc's own text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST, make_model
from surgery.training import UptrainOptions, uptrain
from surgery.training.retrieval_mix import TASKS, RetrievalMix
from surgery.training.teacher_pass import teacher_pass, training_windows
from surgery.retrieval_mix import answer_positions
from surgery.retrieval_tasks import Packed, make_packed
from surgery.training.teacher_store import spec_difference, window_hash, windows_spec

from inprocess import cli_args, uptrain_error

SEQ = 1024
RUN = FAST | dict(seq_len=SEQ, batch_tokens=2 * SEQ, micro_batch=2, tokens=4 * SEQ, loss="kd", retrieval_mix=0.5)


@pytest.fixture(scope="module")
def windows(tokenizer) -> torch.Tensor:
    """Windows of pydoc's text, packed as a run packs them."""
    from surgery.data import load_texts
    from surgery.training.data import pack

    return pack(load_texts("pydoc"), tokenizer, SEQ, 0, 12 * SEQ).train[:12]


def test_the_choice_holds_its_fraction_in_every_stretch_and_depends_on_seed_and_place_only(tokenizer):
    for p in (0.0, 0.3, 0.5, 1.0):
        mix = RetrievalMix(p, 0, tokenizer, SEQ)
        picks = [mix.chosen(g) for g in range(1000)]
        assert sum(picks) == mix.count(1000) and abs(sum(picks) - 1000 * p) <= 1
        for start in range(0, 960, 37):  # any stretch of 40 windows: floor or ceil of 40 P
            assert abs(sum(picks[start:start + 40]) - 40 * p) < 1
        assert picks == [RetrievalMix(p, 0, tokenizer, SEQ).chosen(g) for g in range(1000)]  # a fresh one agrees
    assert ([RetrievalMix(0.3, 0, tokenizer, SEQ).chosen(g) for g in range(100)]
            != [RetrievalMix(0.3, 1, tokenizer, SEQ).chosen(g) for g in range(100)])
    mix = RetrievalMix(1.0, 0, tokenizer, SEQ)
    assert {mix.example(g, list(range(3, 3 + SEQ))).task for g in range(24)} == set(TASKS)


def _shares_a_run(a: list[int], b: list[int], n: int) -> bool:
    """`a` and `b` have a run of `n` tokens in common."""
    runs = {tuple(b[i:i + n]) for i in range(len(b) - n + 1)}
    return any(tuple(a[i:i + n]) in runs for i in range(len(a) - n + 1))


def test_a_retrieval_window_is_one_training_window_of_its_own_text_with_the_answer_at_the_end(tokenizer, windows):
    mix = RetrievalMix(0.5, 3, tokenizer, SEQ)
    out = mix.apply(windows, first=100)
    assert out.shape == windows.shape and out.dtype == windows.dtype
    assert torch.equal(out, RetrievalMix(0.5, 3, tokenizer, SEQ).apply(windows.clone(), first=100))
    # split as steps, processes or a resumed run split them: the same windows
    assert torch.equal(torch.cat([mix.apply(windows[:5], first=100), mix.apply(windows[5:], first=105)]), out)
    chosen = [i for i in range(len(windows)) if mix.chosen(100 + i)]
    assert len(chosen) == mix.count(112) - mix.count(100) == 6
    for i in range(len(windows)):
        if i not in chosen:
            assert torch.equal(out[i], windows[i])
            continue
        example = mix.example(100 + i, windows[i].tolist())
        answer = [t for item in example.items for t in item]
        assert out[i].tolist() == example.ids and example.length == SEQ
        assert out[i, -len(answer):].tolist() == answer and example.answer_start == SEQ - len(answer)
        assert not torch.equal(out[i], windows[i])
        assert _shares_a_run(out[i].tolist(), windows[i].tolist(), 64)  # the haystack: the window's own text
        assert not _shares_a_run(out[i].tolist(), windows[(i + 1) % len(windows)].tolist(), 64)
    unchosen = next(g for g in range(100, 112) if not mix.chosen(g))
    one = windows[:1]
    assert mix.apply(one, first=unchosen) is one  # nothing chosen: the windows as they were
    same, weights = mix.weighted(windows, first=100)
    assert torch.equal(same, out) and weights is None  # weight 1: no weights
    heavy = RetrievalMix(0.5, 3, tokenizer, SEQ, answer_weight=8.0)
    same, weights = heavy.weighted(windows, first=100)
    assert torch.equal(same, out) and weights.shape == windows.shape
    for i in range(len(windows)):  # 8 at the positions predicting an answer token (answer_start - 1 .. SEQ - 2)
        start = mix.example(100 + i, windows[i].tolist()).answer_start if i in chosen else SEQ
        expected = torch.ones(SEQ)
        expected[start - 1:SEQ - 1] = 8.0
        assert torch.equal(weights[i], expected)


LONG = 4 * SEQ  # windows long enough for four questions of this tokenizer's (long) tokens


def test_a_packed_window_asks_its_questions_of_its_own_text_in_turn(tokenizer):
    from surgery.data import load_texts
    from surgery.training.data import pack

    windows = pack(load_texts("pydoc"), tokenizer, LONG, 0, 4 * LONG).train[:4]
    mix = RetrievalMix(1.0, 5, tokenizer, LONG, questions=4, answer_weight=8.0)
    mix.check_length()
    out, weights = mix.weighted(windows, first=10)
    assert torch.equal(out, RetrievalMix(1.0, 5, tokenizer, LONG, questions=4).apply(windows.clone(), first=10))
    tasks = []
    for i in range(len(windows)):
        example = mix.example(10 + i, windows[i].tolist())
        assert isinstance(example, Packed) and out[i].tolist() == example.ids and example.length == LONG
        assert len(example.answers) == 4 and example.answers[-1][1] == LONG  # the last answer ends the window
        assert all(a[1] < b[0] for a, b in zip(example.answers, example.answers[1:]))  # a question between answers
        assert example.tasks.count("passkey") <= 1
        assert _shares_a_run(out[i].tolist(), windows[i].tolist(), 64)  # the haystack: the window's own text
        before = tokenizer.decode(example.ids[:example.answers[0][0]])  # the text before the first answer
        for start, end in example.answers:  # every answer's words were said before any question is answered
            assert all(word in before for word in tokenizer.decode(example.ids[start:end]).split())
        expected = torch.ones(LONG)
        expected[answer_positions(example)] = 8.0
        assert torch.equal(weights[i], expected) and int((expected == 8).sum()) == sum(e - s for s, e in
                                                                                      example.answers)
        tasks += example.tasks
    assert set(tasks) == set(TASKS)
    assert mix.record(10)["questions"] == 4 and "questions" not in RetrievalMix(1.0, 5, None, LONG).record(10)
    with pytest.raises(SurgeryError, match="the pass key at most once"):
        make_packed(tokenizer, LONG, [("passkey", 0.2), ("passkey", 0.7)], seed=0)
    with pytest.raises(SurgeryError, match="--seq-len 1024 is too short for 4 questions a window .*is enough"):
        RetrievalMix(0.5, 0, tokenizer, SEQ, questions=4).check_length()
    # a store's windows hold as many questions as the run's
    o = UptrainOptions(model="unused", out=Path("unused"), **(RUN | dict(seq_len=LONG, batch_tokens=LONG, tokens=4 * LONG,
                                                                       retrieval_questions=4)))
    spec = windows_spec(o, tokenizer, 1)
    assert spec["retrieval_questions"] == 4
    assert spec_difference(windows_spec(o.model_copy(update={"retrieval_questions": 1}), tokenizer, 1), spec) == \
        "--retrieval-questions: store 1, run 4"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tokenizer):
    """The tiny Llama with positions for windows of 1,024."""
    return make_model(tmp_path_factory.mktemp("teacher") / "teacher", tokenizer, positions=SEQ)


@pytest.fixture(scope="module")
def student(tmp_path_factory, tokenizer):
    return make_model(tmp_path_factory.mktemp("student") / "student", tokenizer, seed=1, positions=SEQ)


@pytest.mark.parametrize("mode", ["packed", pytest.param("stream", marks=pytest.mark.slow)])  # ~15 s each
def test_teacher_pass_and_uptrain_mix_the_same_windows_and_a_mismatch_is_refused(teacher, student, tokenizer, tmp_path,
                                                                                 mode):
    o = UptrainOptions(model=str(teacher), out=tmp_path / "unused", data_mode=mode, **RUN)
    plain = torch.cat(list(training_windows(o.model_copy(update={"retrieval_mix": 0.0}), tokenizer, 0)))
    mixed = torch.cat(list(training_windows(o, tokenizer, 0)))
    mix = RetrievalMix(0.5, 0, tokenizer, SEQ)
    changed = [not torch.equal(a, b) for a, b in zip(plain, mixed)]
    assert changed == [mix.chosen(g) for g in range(len(plain))] and sum(changed) == 2
    store = tmp_path / "store"
    manifest = teacher_pass(str(teacher), store, o, 8, device="cpu", progress=False)
    assert manifest["windows_spec"]["retrieval_mix"] == 0.5
    from safetensors.torch import load_file

    assert torch.equal(load_file(store / manifest["shards"][0]["file"])["window_hash"], window_hash(mixed))
    # the run checks every window it trains on against the store's hash: it trains on exactly these
    # (the answers weighted: the stored KD term with position weights; the weights change no window)
    rec = uptrain(UptrainOptions(model=str(student), out=tmp_path / "o", teacher_logprobs=str(store), data_mode=mode,
                                 retrieval_answer_weight=16.0, **RUN))
    assert rec["retrieval_mix"] == {"fraction": 0.5, "tasks": list(TASKS), "windows": 2, "of": 4, "answer_weight": 16.0}
    with pytest.raises(SurgeryError, match=r"other training windows \(--retrieval-mix: store 0.5, run 0.0\)"):
        uptrain(UptrainOptions(model=str(student), out=tmp_path / "o2", teacher_logprobs=str(store), data_mode=mode,
                               **(RUN | dict(retrieval_mix=0.0))))
    assert not (tmp_path / "o2").exists()


def test_bad_mixes_are_refused_in_one_line(teacher, student, tokenizer, monkeypatch, capsys, cli, tmp_path):
    base = [student, "--out", tmp_path / "o", "--teacher", teacher, *cli_args(RUN)]
    for bad in ("1.5", "-0.1", "nan"):
        assert "--retrieval-mix must" in uptrain_error(monkeypatch, capsys, *base, "--retrieval-mix", bad)
    assert "not with --loss-on assistant" in uptrain_error(monkeypatch, capsys, *base, "--loss-on", "assistant")
    assert "not with --on-policy" in uptrain_error(monkeypatch, capsys, *base, "--on-policy", "0.5")
    assert "--retrieval-answer-weight must be positive" in uptrain_error(monkeypatch, capsys, *base,
                                                                        "--retrieval-answer-weight", "0")
    plain = [student, "--out", tmp_path / "o", "--teacher", teacher,
             *cli_args({k: v for k, v in RUN.items() if k != "retrieval_mix"})]
    assert "it needs --retrieval-mix above 0" in uptrain_error(monkeypatch, capsys, *plain,
                                                               "--retrieval-answer-weight", "4")
    assert "--retrieval-questions must be at least 1" in uptrain_error(monkeypatch, capsys, *base,
                                                                       "--retrieval-questions", "0")
    assert "it needs --retrieval-mix above 0" in uptrain_error(monkeypatch, capsys, *plain, "--retrieval-questions", "2")
    assert "too short for 8 questions a window" in uptrain_error(monkeypatch, capsys, *base, "--retrieval-questions", "8")
    short = uptrain_error(monkeypatch, capsys, *base, "--seq-len", 64, "--batch-tokens", 512)
    assert "--retrieval-mix: --seq-len 64 is too short for" in short and "is enough" in short
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()
    with pytest.raises(SurgeryError, match="--seq-len 512 is too short for niah_multikey .*--seq-len 1024 is enough"):
        RetrievalMix.of(UptrainOptions(model=str(teacher), out=Path("unused"), **(RUN | dict(seq_len=512))), tokenizer)
    flags = ["--top-k", 4, "--device", "cpu", "--data", "pydoc", "--tokens", 2048, "--seq-len", 64,
             "--batch-tokens", 512, "--eval-tokens", 1024, "--retrieval-mix", 0.5]
    code, _, err = cli("teacher", teacher, "--out", tmp_path / "t", *flags)
    assert code == 2 and "--seq-len 64 is too short for" in err and not (tmp_path / "t").exists()
    code, _, err = cli("teacher", teacher, "--out", tmp_path / "t", *flags[:-1], 2)
    assert code == 2 and "--retrieval-mix must lie in [0, 1], got 2" in err


def test_a_recipe_takes_the_mix_for_its_uptrain_step_and_the_teacher_step_that_serves_it(tmp_path):
    from surgery.recipes import load_recipe
    from surgery.recipes.plan import build_plan

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "llama3-8b-gqa2-stored-teacher.yaml"
    plan = build_plan(load_recipe(recipe, ["uptrain.retrieval_mix=0.25", "uptrain.retrieval_questions=3"]),
                      tmp_path / "plan")
    commands = {r["name"]: r["command"] for r in plan["steps"]}
    for flag in ("--retrieval-mix 0.25", "--retrieval-questions 3"):  # the store's windows are the run's
        assert flag in commands["teacher"] and flag in commands["uptrain"]
    with pytest.raises(SurgeryError, match=r"uptrain: retrieval_mix must lie in \[0, 1\], got 2"):
        load_recipe(recipe, ["uptrain.retrieval_mix=2"])
