"""The chunked output head (surgery/training/heads.py) under mixed precision, and the dry run's memory when a model
cannot use it."""

from __future__ import annotations

import torch
import transformers as tf

from surgery.training.heads import OutputHead
from surgery.training.accelerator import make_accelerator

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)


def test_the_chunked_head_is_active_under_accelerate_s_bf16_autocast():
    """accelerate's bf16 wrapper makes the model's logits bf16 products; the probe must not mistake that rounding
    for a step after the projection (it did: the run then held whole [B, T, V] fp32 logits, silently)."""
    torch.manual_seed(0)
    acc = make_accelerator("bf16")
    assert acc.mixed_precision == "bf16" and (acc.device.type == "cuda" or acc.device.type == "cpu")
    model = acc.prepare(tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)))
    ids = torch.arange(10, device=acc.device)[None]
    seen = []
    handle = acc.unwrap_model(model).lm_head.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    logits = model(input_ids=ids).logits
    handle.remove()
    assert seen == [torch.bfloat16]  # the wrapper's autocast is really on

    head = OutputHead.of(acc.unwrap_model(model), 64)
    assert head is not None  # the chunked head is used under bf16
    with acc.autocast(), head.returning_hidden():  # as the loop runs it: hidden states, projected in the losses
        hidden = model(input_ids=ids).logits
    with acc.autocast():
        projected = head.project(hidden)
    assert projected.dtype == torch.bfloat16
    torch.testing.assert_close(projected.float(), logits.float(), rtol=0, atol=0)  # the same product, bit for bit
    assert model(input_ids=ids).logits.shape == (1, 10, 64)  # the probe left the forward as it found it

    capped = acc.prepare(tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, head_dim=16, final_logit_softcapping=0.05)))
    assert OutputHead.of(acc.unwrap_model(capped), 64) is None  # a real step after the projection still shows


def test_the_dry_run_counts_whole_logits_where_the_head_cannot_chunk(tmp_path):
    """A model whose logits are not its projection's (soft-capping, scaling) keeps the whole fp32 logits and their
    gradient: the estimate adds them; the same rule as the probe's, on the same models."""
    from types import SimpleNamespace

    from surgery.memory_estimate import chunked_head, stats_from_folder, uptrain_memory

    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))
    capped = tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, head_dim=16, final_logit_softcapping=30.0))
    scaled = tf.CohereForCausalLM(tf.CohereConfig(**SMALL))
    for model in (llama, capped, scaled):
        folder = tmp_path / type(model).__name__
        model.save_pretrained(folder)
        stats = stats_from_folder(folder)
        assert chunked_head(stats.config) == (OutputHead.of(model, 64) is not None)

    big_vocab = 128_256  # Llama-3's: where it matters
    options = SimpleNamespace(micro_batch=4, seq_len=2048, batch_tokens=8192, train="all",
                              gradient_checkpointing=True, hidden_weight=0.0)
    base = stats_from_folder(tmp_path / "LlamaForCausalLM")
    plain = uptrain_memory(base.__class__(**(vars(base) | {"vocab": big_vocab})), options, None, 1)
    soft = uptrain_memory(base.__class__(**(vars(base) | {"vocab": big_vocab, "config": base.config | {
        "final_logit_softcapping": 30.0}})), options, None, 1)
    n = options.micro_batch * options.seq_len
    assert soft - plain >= 2 * 4 * n * big_vocab  # at least the fp32 logits and their gradient (8 GiB here)
