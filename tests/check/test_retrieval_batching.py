"""`check --retrieval` scores the examples of one task and length stacked in batches (they are all as long): the
same hits and log-probabilities as one by one, still only the answers' logits, never a batch across two rungs; on a
text haystack each sample reads its own stretch of the text; and `--retrieval-metric string` scores as RULER does."""

from __future__ import annotations

import pytest
import torch

from surgery.checking.generate import greedy
from surgery.checking.retrieval import (MAX_BATCH_TOKENS, RetrievalPlan, batches, plan_retrieval,
                                        score_retrieval)
from surgery.errors import SurgeryError
from surgery.retrieval_tasks import Example, make_examples, text_start
from surgery.testing.pydoc_llama import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM

    folder = make_model(tmp_path_factory.mktemp("retrieval") / "tiny", tokenizer, positions=1024)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@torch.no_grad()
def test_batched_scores_are_the_one_by_one_scores(model, tokenizer):
    plan = plan_retrieval("passkey,variable_tracking", [448, 512], 5, "noise", tokenizer, 1024, 512,
                          None, batch=4)
    heads = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: heads.append(tuple(args[0].shape)))
    batched = score_retrieval(model, plan, torch.device("cpu"), progress=False)
    hook.remove()
    plan.batch = 1
    alone = score_retrieval(model, plan, torch.device("cpu"), progress=False)
    assert len(batched) == len(alone) == 2 * 2 * 5
    assert [(r["task"], r["length"], r["depth"], r["score"]) for r in batched] == \
        [(r["task"], r["length"], r["depth"], r["score"]) for r in alone]
    assert [r["logprob"] for r in batched] == pytest.approx([r["logprob"] for r in alone], abs=1e-4)
    # 5 examples per rung: a batch of 4, then the rung's last one alone (never with the next rung's first); the LM
    # head saw each batch's answer positions only (its longest answer, and one more)
    plan.batch = 4
    expected = [(len(b), max(e.length - e.answer_start for e in b) + 1) for b in batches(plan.examples(), 5, 4)]
    assert [h[0] for h in heads] == [4, 1] * 4 and heads == [(n, keep, 64) for n, keep in expected]
    assert max(keep for _, keep in expected) < 64


def test_batches_keep_to_one_rung_and_the_token_budget(tokenizer):
    examples = [e for n in (256, 384) for e in make_examples("passkey", tokenizer, n, 3)]
    assert [[e.length for e in b] for b in batches(iter(examples), 3, 2)] == [[256, 256], [256], [384, 384], [384]]
    long = make_examples("passkey", tokenizer, 1024, 3)
    assert [len(b) for b in batches(iter(long), 3, 64)] == [3]
    assert max(1, MAX_BATCH_TOKENS // 20000) == 1  # a 20k-token example goes alone whatever --retrieval-batch says


def test_each_sample_reads_its_own_stretch_of_a_text_haystack(tokenizer):
    text = tokenizer("".join(f"Line {i} of the text. " for i in range(3000)))["input_ids"]
    n, samples = 512, 4
    starts = [text_start(len(text), n, i, samples) for i in range(samples)]
    assert starts[0] == 0 and starts[-1] == len(text) - n and all(b - a >= n for a, b in zip(starts, starts[1:]))
    examples = make_examples("niah_single", tokenizer, n, samples, haystack_tokens=text)
    decoded = [tokenizer.decode(e.ids) for e in examples]
    firsts = [int(d.split("Line ")[1].split()[0]) for d in decoded]  # the first line of text each example reads
    assert firsts == sorted(firsts) and len(set(firsts)) == samples
    lines = [{int(part.split()[0]) for part in d.split("Line ")[1:] if part.split()[0].isdigit()} for d in decoded]
    assert all(not (a & b) for i, a in enumerate(lines) for b in lines[i + 1:])  # disjoint stretches


@torch.no_grad()
def test_a_plan_of_examples_scores_in_batches_too(model, tokenizer):
    examples = make_examples("niah_single", tokenizer, 256, 3)
    rows = score_retrieval(model, RetrievalPlan.of(["niah_single"], [256], 3, "noise", examples, batch=3),
                           torch.device("cpu"), progress=False)
    one = [score_retrieval(model, RetrievalPlan.of(["niah_single"], [256], 1, "noise", [e]), torch.device("cpu"),
                           progress=False)[0] for e in examples]
    assert [r["score"] for r in rows] == [r["score"] for r in one]
    assert [r["logprob"] for r in rows] == pytest.approx([r["logprob"] for r in one], abs=1e-4)


def test_needles_stand_at_their_depths_spread_over_the_haystack(tokenizer):
    """Sample i's needle stands (i + 0.5) / samples of the way through the haystack (to the nearest sentence end)."""
    samples, n = 5, 1024
    intro = len(tokenizer("There is an important piece of information hidden inside a lot of irrelevant text. Find it "
                          "and memorize it. I will quiz you about it afterwards.\n",
                          add_special_tokens=False)["input_ids"])
    for i, e in enumerate(make_examples("passkey", tokenizer, n, samples)):
        key = tokenizer.decode(e.items[0]).strip()
        needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key.",
                           add_special_tokens=False)["input_ids"]
        at = next(p for p in range(len(e.ids)) if e.ids[p:p + len(needle)] == needle)
        question = e.answer_start - len(tokenizer("\nWhat is the pass key? The pass key is",
                                                  add_special_tokens=False)["input_ids"])
        fill = question - intro - len(needle)  # the haystack's tokens
        assert e.depth == (i + 0.5) / samples and abs((at - intro) / fill - e.depth) < 0.02, (i, at, fill)


@torch.no_grad()
def test_the_string_metric_finds_the_answer_anywhere_in_the_greedy_continuation(model, tokenizer):
    """RULER's string match on the model's own greedy continuation of one prompt: an answer it writes first is a hit
    by both metrics; the same answer written one token late (after something else, as a model writes "is: N") a
    string hit and an exact miss; text it never writes a miss by both. The exact score and the log-probability stay
    in each row, the same as the exact metric's."""
    base = make_examples("niah_single", tokenizer, 256, 1)[0]
    prompt = base.ids[:base.answer_start]
    said = greedy(model, torch.tensor([prompt]), 3 + 4)[0].tolist()
    assert said[:3] != said[1:4]  # the late answer differs from the first one (else the case tests nothing)
    written = tokenizer.decode(said, skip_special_tokens=True).lower()
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip().lower()
    absent = next(t for t in range(tokenizer.vocab_size) if text([t] * 3) and text([t] * 3) not in written)
    answers = {"first": said[:3], "late": said[1:4], "absent": [absent] * 3}
    examples = [Example("niah_single", len(prompt) + 3, 0.5, prompt + a, [a]) for a in answers.values()]
    args = (["niah_single"], [len(prompt) + 3], 3, "noise", examples)
    string = score_retrieval(model, RetrievalPlan.of(*args, batch=3, metric="string", tokenizer=tokenizer),
                             torch.device("cpu"), progress=False)
    exact = score_retrieval(model, RetrievalPlan.of(*args, batch=3), torch.device("cpu"), progress=False)
    assert [r["score"] for r in string] == [1.0, 1.0, 0.0]
    assert [r["exact"] for r in string] == [r["score"] for r in exact] == [1.0, 0.0, 0.0]
    assert [r["logprob"] for r in string] == pytest.approx([r["logprob"] for r in exact], abs=1e-5)
    assert all(r["said"] == tokenizer.decode(said, skip_special_tokens=True) for r in string)
    with pytest.raises(SurgeryError, match="needs a tokenizer"):
        score_retrieval(model, RetrievalPlan.of(*args, metric="string"), torch.device("cpu"), progress=False)
