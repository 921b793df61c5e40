"""SwitchHead's routed experts without host syncs: the batched (block-padded) grouped matmul computes what the
sort-and-loop implementation it replaced computed (kept here as the reference), forward and backward, with no sync
and no graph break in a model's forward, and only the selected experts' rows (plus at most one block each)."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers as tf

from surgery.checkpoint.source import resolve_source
from surgery.switchhead import convert_to_switchhead
from surgery.switchhead.options import SwitchHeadOptions
from surgery.switchhead import modeling_switchhead as msh
from surgery.testing import tiny_models as tm
from surgery.testing.host_syncs import count_host_syncs, graph_breaks
from surgery.testing.switchhead_loop import loop_outputs, loop_values


def reference_values(w, b, x, gates, index):
    return loop_values(msh, w, b, x, gates, index)


def reference_outputs(w, a, gates, index):
    return loop_outputs(msh, w, a, gates, index)


def _experts(heads, n_exp, d, dim, gen):
    v, o = msh.SwitchHeadExperts(heads, n_exp, dim, d, bias=True), msh.SwitchHeadExperts(heads, n_exp, d, dim, bias=False)
    with torch.no_grad():
        for p in (*v.parameters(), *o.parameters()):
            p.normal_(generator=gen)
    return v, o


@pytest.mark.parametrize("n,k", [(129, 1), (300, 2), (1000, 3)])
def test_grouped_experts_match_the_loop_forward_and_backward(n, k):
    gen = torch.Generator().manual_seed(n)
    heads, n_exp, d, dim = 3, 5, 8, 32
    v, o = _experts(heads, n_exp, d, dim, gen)
    x = torch.randn(n, dim, generator=gen, requires_grad=True)
    a = torch.randn(n, heads, d, generator=gen, requires_grad=True)
    router = msh.SigmaMoERouter(dim, heads, n_exp, k)
    with torch.no_grad():
        router.weight.normal_(generator=gen)
    gates, index = router(x.detach())
    gates = gates.detach().requires_grad_(True)
    up_v, up_o = torch.randn(n, heads, d, generator=gen), torch.randn(n, dim, generator=gen)
    grads = {}
    for name, values, outputs in (
            ("new", lambda: msh.expert_values(v, x, gates, index), lambda: msh.expert_outputs(o, a, gates, index)),
            ("old", lambda: reference_values(v.weight, v.bias, x, gates, index),
             lambda: reference_outputs(o.weight, a, gates, index))):
        for p in (x, a, gates, *v.parameters(), *o.parameters()):
            p.grad = None
        y_v, y_o = values(), outputs()
        ((y_v * up_v).sum() + (y_o * up_o).sum()).backward()
        grads[name] = [y_v.detach(), y_o.detach()] + [p.grad.clone() for p in (x, a, gates, *v.parameters(), o.weight)]
    for new, old in zip(grads["new"], grads["old"]):
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-4)


def test_only_the_selected_rows_are_multiplied_up_to_a_block_per_expert():
    """FLOPs of the grouped matmul: one (d x D) product per selected (token, head, expert), plus padding under one
    block of rows per expert and one trailing block."""
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(0)
    heads, n_exp, d, dim = 3, 4, 8, 32
    v, o = _experts(heads, n_exp, d, dim, gen)
    for n in (200, 3000):
        x, a = torch.randn(n, dim, generator=gen), torch.randn(n, heads, d, generator=gen)
        for k in (1, 2, 3):
            index = torch.rand(n, heads, n_exp, generator=gen).topk(k, -1).indices
            gates = torch.rand(n, heads, k, generator=gen)
            with FlopCounterMode(display=False) as counter:
                msh.expert_values(v, x, gates, index)
                msh.expert_outputs(o, a, gates, index)
            selected = n * heads * k
            pad = (heads * n_exp + 1) * msh.expert_block_rows(selected, heads * n_exp)
            assert pad <= selected / 2 or n == 200  # (few tokens, small blocks: padding weighs more)
            assert 4 * selected * d * dim <= counter.get_total_flops() <= 4 * (selected + pad) * d * dim


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """A tiny Llama converted to H=2 heads of E=4 experts, k=2 selected."""
    folder = tmp_path_factory.mktemp("routing")
    tm.tiny("llama", folder / "src")
    convert_to_switchhead(resolve_source(str(folder / "src")), folder / "sh",
                          SwitchHeadOptions(heads=2, experts=4, topk=2, calib=["pydoc"], calib_tokens=512), progress=False)
    return tf.AutoModelForCausalLM.from_pretrained(folder / "sh", trust_remote_code=True, dtype=torch.float32).eval()


@pytest.mark.parametrize("length", [12, 100])  # 24 tokens a call: every expert (dense); 200: routed
def test_a_forward_makes_no_host_sync_and_no_graph_break(routed, length):
    shipped = sys.modules[type(routed).__module__]  # the checkpoint's own copy of the modeling code
    ids = tm.sample_ids(batch=2, length=length)
    assert (ids.numel() > shipped.DENSE_TOKENS) == (length == 100)
    with torch.no_grad():
        routed(input_ids=ids)
        with count_host_syncs([shipped.__file__]) as counted:
            routed(input_ids=ids)
        assert counted.total == 0  # main: bincount + tolist for each side of each layer, 8 a forward
        assert graph_breaks(routed, input_ids=ids) == 0  # main: 10 (dense) and 18 (routed)
