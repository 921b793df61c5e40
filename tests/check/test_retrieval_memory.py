"""`check --retrieval` never computes a window's logits over the vocabulary: the LM head sees the answer's positions
(and one more) only, so its memory does not grow with the length times the vocabulary."""

from __future__ import annotations

import torch

from surgery.checking.retrieval import RetrievalPlan, score_retrieval
from surgery.retrieval_tasks import make_examples
from surgery.testing.pydoc_llama import make_model


@torch.no_grad()
def test_scoring_feeds_the_lm_head_the_answer_positions_only(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "tiny", tokenizer, positions=1024)).eval()
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    examples = [e for task in ("passkey", "variable_tracking") for e in make_examples(task, tokenizer, 1024, 1)]
    scores = score_retrieval(model, RetrievalPlan.of(["passkey", "variable_tracking"], [1024], 1, "noise", examples),
                   torch.device("cpu"), progress=False)
    hook.remove()
    assert len(scores) == 2 and rows == [e.length - e.answer_start + 1 for e in examples] and max(rows) < 64


@torch.no_grad()
def test_scoring_builds_the_examples_one_rung_at_a_time(tmp_path, tokenizer):
    """The plan keeps no example: scoring builds each task and length's examples as it reaches them, so memory
    holds one rung's examples (`samples` of them), never the whole ladder's; the scores are those of the examples
    built up front."""
    import weakref

    from transformers import AutoModelForCausalLM

    from surgery.checking.retrieval import plan_retrieval

    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "tiny", tokenizer, positions=1024)).eval()
    plan = plan_retrieval("passkey,niah_single", [256, 384, 512], 2, "noise", tokenizer, 1024, 512, None)
    live, most, inner = [0], [0], plan.build

    def gone():
        live[0] -= 1

    def counted():
        for e in inner():
            live[0] += 1
            weakref.finalize(e, gone)
            most[0] = max(most[0], live[0])
            yield e

    plan.build = counted
    rows = score_retrieval(model, plan, torch.device("cpu"), progress=False)
    assert len(rows) == 12 and most[0] <= 3  # one rung (2 samples) and the example scored last
    every = list(inner())
    assert plan.tokens == sum(e.length for e in every) == 2 * 2 * (256 + 384 + 512)
    again = score_retrieval(model, RetrievalPlan.of(plan.tasks, plan.lengths, 2, "noise", every), torch.device("cpu"),
                  progress=False)
    assert rows == again
