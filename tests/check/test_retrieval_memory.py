"""`check --retrieval` never computes a window's logits over the vocabulary: the LM head sees the answer's positions
(and one more) only, so its memory does not grow with the length times the vocabulary."""

from __future__ import annotations

import torch

from surgery.checking.retrieval import RetrievalPlan, score
from surgery.checking.retrieval_tasks import make_examples
from surgery.testing.pydoc_llama import make_model


@torch.no_grad()
def test_scoring_feeds_the_lm_head_the_answer_positions_only(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "tiny", tokenizer, positions=1024)).eval()
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    examples = [e for task in ("passkey", "variable_tracking") for e in make_examples(task, tokenizer, 1024, 1)]
    scores = score(model, RetrievalPlan(["passkey", "variable_tracking"], [1024], 1, "noise", examples),
                   torch.device("cpu"), progress=False)
    hook.remove()
    assert len(scores) == 2 and rows == [e.length - e.answer_start + 1 for e in examples] and max(rows) < 64
