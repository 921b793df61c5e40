"""Talking-heads attention's device path, forced on CPU: blocks sized for a GPU's memory (a 4k-token forward is a
few blocks per layer), no host sync per forward, the source's function to 1e-5, no graph break under torch.compile."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import transformers as tf

from surgery.checkpoint.source import resolve_source
from surgery.talking_heads import convert_to_talking_heads
from surgery.talking_heads.options import TalkingHeadsOptions
from surgery.talking_heads import modeling_talking_heads as mth
from surgery.testing import tiny_models as tm
from surgery.testing.host_syncs import count_host_syncs, graph_breaks


def _forced(module, device_type: str):
    """`module`'s block_plan answering for `device_type` whatever the tensors' device (restored by the caller)."""
    plan = module.block_plan
    return lambda _: plan(device_type)


def test_blocks_are_cache_sized_on_cpu_and_memory_sized_elsewhere():
    cpu, cuda = mth.block_plan("cpu"), mth.block_plan("cuda")
    assert cpu == (mth.BLOCK_ELEMENTS, True) and cuda == (mth.DEVICE_BLOCK_ELEMENTS, False)
    # Llama-3-8B's 32 heads at 4,096 tokens: ~8k blocks per 32-layer forward on CPU, a few per layer on a GPU
    rows_cpu, rows_cuda = mth._block_rows(cpu, 1, 32, 4096), mth._block_rows(cuda, 1, 32, 4096)
    assert 32 * -(-4096 // rows_cpu) >= 8000 and -(-4096 // rows_cuda) <= 4
    # a GPU block's scores stay under the budget whatever the batch
    for batch in (1, 16, 64):
        rows = mth._block_rows(cuda, batch, 32, 4096)
        assert rows == 1 or batch * 32 * rows * 4096 <= mth.DEVICE_BLOCK_ELEMENTS


@pytest.mark.parametrize("grouped", [True, False])
def test_the_device_path_gives_the_same_outputs_without_host_syncs(grouped, monkeypatch):
    torch.manual_seed(0)
    b, h, kv, t, d = 3, 8, 2, 13, 8
    settings = dict(heads=h, head_dim=d, logits_mixing=not grouped, weights_mixing=not grouped, heads_logits=16 if
                    not grouped else h, heads_weights=4 if not grouped else h, pair_rotary_dims=True, chunk_size=5)
    mixer = mth.TalkingHeadsMixing(settings)
    if not grouped:
        with torch.no_grad():
            mixer.logits_mix.normal_()
            mixer.weights_mix.normal_().abs_()
    module = types.SimpleNamespace(talking_heads=mixer, training=False, is_causal=True)
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, kv, t, d), torch.randn(b, kv, t, d)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None].repeat(b, 1, 1)
    allowed[1, :, :4] = False  # left padding
    allowed[2, :, :1] = False
    allowed[2] &= torch.ones(t, t, dtype=torch.bool).triu(-5)  # a sliding window
    keep = allowed.any(-1)  # rows that see some key (fully masked rows are meaningless)
    results, syncs = {}, {}
    for device in ("cpu", "cuda"):
        monkeypatch.setattr(mth, "block_plan", _forced(mth, device) if device != "cpu" else mth.block_plan)
        with count_host_syncs([mth.__file__]) as counted:
            results[device], _ = mth.talking_heads_attention(module, q, k, v, allowed[:, None], scaling=0.3)
        syncs[device] = counted.total
        monkeypatch.undo()
    assert syncs["cpu"] > 0 and syncs["cuda"] == 0  # the CPU narrows each block's keys on the host; CUDA does not
    torch.testing.assert_close(results["cuda"][keep], results["cpu"][keep], rtol=1e-5, atol=1e-5)


def test_a_converted_model_on_the_device_path_is_the_source_function_without_syncs_or_graph_breaks(tmp_path):
    tm.make_tiny("llama", tmp_path / "src")
    convert_to_talking_heads(resolve_source(str(tmp_path / "src")), tmp_path / "th", TalkingHeadsOptions(chunk_size=7),
                             progress=False)
    source = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "th", dtype=torch.float32, trust_remote_code=True).eval()
    shipped = sys.modules[type(model).__module__]  # the checkpoint's own copy of the modeling code
    ids = tm.sample_ids(batch=2, length=24)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    original = shipped.block_plan
    shipped.block_plan = _forced(shipped, "cuda")
    try:
        with torch.no_grad():
            with count_host_syncs([shipped.__file__]) as counted:
                out = model(input_ids=ids, attention_mask=mask).logits
            expected = source(input_ids=ids, attention_mask=mask).logits
            breaks = graph_breaks(model, input_ids=ids, attention_mask=mask)
    finally:
        shipped.block_plan = original
    assert counted.total == 0
    assert (out - expected)[mask.bool()].abs().max() <= 1e-5
    assert breaks == 0
