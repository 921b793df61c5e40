"""The aligned merge's key and value refits (`surgery.kv.aligned.keyrefit`, `surgery.kv.aligned.valuerefit`): each lowers its
own objective on real (RoPE-rotated) tensors, and leaves exact merges exact."""

from __future__ import annotations

import torch

from surgery.kv.aligned.keyrefit import KeyRefit, refit_keys
from surgery.kv.aligned.pipeline import project_heads
from surgery.fitting.rotary import rotary_pairs
from surgery.kv.aligned.valuerefit import ValueRefit, refit_values, solve_kronecker_sum

N, L, D, DIN, KV, R = 2, 24, 8, 12, 2, 2  # windows, length, head_dim, input width, K/V heads, queries per K/V head
H = KV * R
SCALING = D**-0.5


def _setup(seed: int = 0, same_kv: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, L, DIN, generator=g)
    q = torch.randn(H * D, DIN, generator=g) * 0.8
    k = torch.randn(KV * D, DIN, generator=g) * 0.8
    v = torch.randn(KV * D, DIN, generator=g) * 0.5
    if same_kv:
        k[D:], v[D:] = k[:D], v[:D]
    o = torch.randn(DIN, H * D, generator=g) * 0.3
    pairs = rotary_pairs(D, D)
    freq = 100.0 ** (-torch.arange(pairs.frequencies) / pairs.frequencies)
    angle = torch.arange(L)[:, None].float() * freq
    cos, sin = angle.cos().expand(N, -1, -1), angle.sin().expand(N, -1, -1)
    return x, q, k, v, o, pairs, cos, sin


def _merged(rows: torch.Tensor) -> torch.Tensor:
    """The members' mean in every slot (the source-shaped layout of a merged K/V head)."""
    return rows.reshape(KV, D, -1).mean(0, keepdim=True).expand(KV, -1, -1).reshape(KV * D, -1).clone()


def _logit_error(x, q, k_rows, q_src, k_src, pairs, cos, sin) -> float:
    """Source-probability-weighted variance of (converted - source) logits per query row, summed (what the key refit
    descends: softmax ignores a per-row offset)."""
    q_cv = project_heads(x, q, D, cos, sin, pairs)
    k_cv = project_heads(x, k_rows, D, cos, sin, pairs).repeat_interleave(R, 1)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    t = SCALING * q_src @ k_src.repeat_interleave(R, 1).transpose(-1, -2)
    p = torch.softmax(t.masked_fill(~causal, float("-inf")), -1)
    diff = SCALING * q_cv @ k_cv.transpose(-1, -2) - t
    mean = (p * diff).sum(-1, keepdim=True)
    return float((p * (diff - mean) ** 2).sum())


def test_key_refit_lowers_the_logit_error_and_keeps_exact_keys():
    x, q, k, _, _, pairs, cos, sin = _setup()
    q_src, k_src = project_heads(x, q, D, cos, sin, pairs), project_heads(x, k, D, cos, sin, pairs)
    merged = _merged(k)
    opts = KeyRefit(samples=L, uniform=0.0, ridge=1e-4, prior=0.0, weight_ridge=1e-6)
    new = refit_keys(x, q_src, k_src, q_src, project_heads(x, merged, D, cos, sin, pairs), [[0, 1]], cos, sin, pairs,
                     SCALING, None, merged, opts, torch.Generator().manual_seed(0))
    before = _logit_error(x, q, merged, q_src, k_src, pairs, cos, sin)
    after = _logit_error(x, q, new, q_src, k_src, pairs, cos, sin)
    assert after < 0.9 * before, (before, after)
    assert torch.equal(new[:D], new[D:])  # one merged head, in both slots
    # groups of one head (nothing merged) keep the source's rows exactly
    same = refit_keys(x, q_src, k_src, q_src, k_src, [[0], [1]], cos, sin, pairs, SCALING, None, k, opts,
                      torch.Generator().manual_seed(0))
    assert torch.equal(same, k)
    # identical K heads merge exactly: the refit has nothing to correct and stays put
    x, q, k, _, _, pairs, cos, sin = _setup(same_kv=True)
    q_src, k_src = project_heads(x, q, D, cos, sin, pairs), project_heads(x, k, D, cos, sin, pairs)
    again = refit_keys(x, q_src, k_src, q_src, k_src, [[0, 1]], cos, sin, pairs, SCALING, None, k, KeyRefit(),
                       torch.Generator().manual_seed(0))
    assert torch.allclose(again, k, atol=1e-4), (again - k).abs().max()


def test_kronecker_sum_solver():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
    b = a @ a.transpose(1, 2)
    c = torch.randn(3, 7, 20, generator=g, dtype=torch.float64)
    z = c @ c.transpose(1, 2)
    rhs = torch.randn(5, 7, generator=g, dtype=torch.float64)
    x = solve_kronecker_sum(b, z, rhs, torch.zeros(5, 7, dtype=torch.float64), 0.0, 200, 1e-12)
    assert torch.einsum("hij,jk,hkl->il", b, x, z).sub(rhs).norm() < 1e-8 * rhs.norm()


def _value_error(x, q, k, v_rows, o_cv, heads_src, o_src, pairs, cos, sin) -> float:
    """sum over heads and positions of |o_h V z_hm - O_h u_hm|^2 (the value refit's objective, all positions)."""
    q_cv = project_heads(x, q, D, cos, sin, pairs)
    k_cv = project_heads(x, k, D, cos, sin, pairs).repeat_interleave(R, 1)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    p = torch.softmax((SCALING * q_cv @ k_cv.transpose(-1, -2)).masked_fill(~causal, float("-inf")), -1)
    vals = (x @ v_rows.T).reshape(N, L, KV, D).transpose(1, 2).repeat_interleave(R, 1)  # [N, H, L, D]
    out = p @ vals
    total = 0.0
    for h in range(H):
        mine = out[:, h] @ o_cv[:, h * D:(h + 1) * D].T
        theirs = heads_src[..., h * D:(h + 1) * D] @ o_src[:, h * D:(h + 1) * D].T
        total += float((mine - theirs).pow(2).sum())
    return total


def test_value_refit_lowers_the_head_output_error_and_keeps_exact_values():
    x, q, k, v, o, pairs, cos, sin = _setup(seed=2)
    # the source: every head's output (what enters o_proj) under its own attention
    q_src, k_src = project_heads(x, q, D, cos, sin, pairs), project_heads(x, k, D, cos, sin, pairs)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    p = torch.softmax((SCALING * q_src @ k_src.repeat_interleave(R, 1).transpose(-1, -2)).masked_fill(~causal, float("-inf")), -1)
    vals = (x @ v.T).reshape(N, L, KV, D).transpose(1, 2).repeat_interleave(R, 1)
    heads_src = (p @ vals).transpose(1, 2).reshape(N, L, H * D)
    merged_k, merged_v = _merged(k), _merged(v)
    opts = ValueRefit(samples=L, ridge=1e-6, iterations=200, tolerance=1e-10)
    new = refit_values(x, q_src, project_heads(x, merged_k, D, cos, sin, pairs), heads_src, [[0, 1]], SCALING, None,
                       merged_v, o, o, opts, torch.Generator().manual_seed(0))
    before = _value_error(x, q, merged_k, merged_v, o, heads_src, o, pairs, cos, sin)
    after = _value_error(x, q, merged_k, new, o, heads_src, o, pairs, cos, sin)
    assert after < 0.9 * before, (before, after)
    assert torch.equal(new[:D], new[D:])
    g = torch.Generator().manual_seed(5)
    for _ in range(3):  # the minimiser of its objective (every position sampled, no ridge): any nudge costs
        nudge = torch.randn(D, DIN, generator=g) * 0.01
        nudged = new + nudge.repeat(KV, 1)
        assert _value_error(x, q, merged_k, nudged, o, heads_src, o, pairs, cos, sin) > after
    # identical V and K heads: the merge is exact and the refit keeps it
    x, q, k, v, o, pairs, cos, sin = _setup(seed=2, same_kv=True)
    q_src, k_src = project_heads(x, q, D, cos, sin, pairs), project_heads(x, k, D, cos, sin, pairs)
    p = torch.softmax((SCALING * q_src @ k_src.repeat_interleave(R, 1).transpose(-1, -2)).masked_fill(~causal, float("-inf")), -1)
    vals = (x @ v.T).reshape(N, L, KV, D).transpose(1, 2).repeat_interleave(R, 1)
    heads_src = (p @ vals).transpose(1, 2).reshape(N, L, H * D)
    again = refit_values(x, q_src, k_src, heads_src, [[0, 1]], SCALING, None, v, o, o, ValueRefit(),
                         torch.Generator().manual_seed(0))
    assert torch.allclose(again, v, atol=1e-4), (again - v).abs().max()
    assert torch.equal(refit_values(x, q_src, k_src, heads_src, [[0], [1]], SCALING, None, v, o, o, ValueRefit(),
                                    torch.Generator().manual_seed(0)), v)


def test_aligned_merge_with_key_and_value_refits(tmp_path):
    """The refits inside the whole aligned conversion (tiny Llama): G = source K/V heads stays exact, 4 -> 1 stays far
    closer to the source than mean pooling, and surgery.json says which refits ran."""
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import MQAOptions
    from surgery.kv.aligned.pipeline import MergeOptions
    from surgery.checkpoint.source import resolve_source
    from surgery.testing.aligned import aligned, heldout_ids, kl_to_source
    from surgery.testing.tiny_models import tiny

    src = tiny("llama", tmp_path / "src")
    opts = MergeOptions(groups=1, refit_k=True, refit_rounds=2, refit_v=True)
    record = aligned(src, tmp_path / "same", 4, merge=opts)
    assert kl_to_source(src, tmp_path / "same", heldout_ids(windows=2))[1] <= 1e-5
    record = aligned(src, tmp_path / "mqa", 1, merge=opts)
    assert record["merge"]["key_refit"] == {"rounds": 2} and record["merge"]["value_refit"] is True
    convert_to_kv_heads(resolve_source(str(src)), tmp_path / "mean", MQAOptions(), progress=False)
    ids = heldout_ids()
    assert kl_to_source(src, tmp_path / "mqa", ids)[0] < 0.5 * kl_to_source(src, tmp_path / "mean", ids)[0]


def test_cli_flags_reach_the_aligned_merge(tmp_path, capsys):
    """`--refit-values` and `--query-samples` (generated from the gqa kind's options model) change the conversion and
    are recorded; a bad value is one line, exit 2."""
    import json

    from inprocess import run_cli
    from surgery.testing.tiny_models import tiny

    src = tiny("llama", tmp_path / "src")
    common = ("convert", str(src), "--to", "mqa", "--merge", "aligned", "--calib-tokens", "256", "--device", "cpu")
    assert run_cli(capsys, *common, "--out", str(tmp_path / "plain"))[0] == 0
    code, _, err = run_cli(capsys, *common, "--refit-values", "--query-samples", "256", "--out", str(tmp_path / "v"))
    assert code == 0, err
    plain, refit = (json.loads((tmp_path / n / "surgery.json").read_text())["merge"] for n in ("plain", "v"))
    assert (plain["value_refit"], plain["query_samples"]) == (False, 128)
    assert (refit["value_refit"], refit["query_samples"]) == (True, 256)
    a, b = ((tmp_path / n / "model.safetensors").read_bytes() for n in ("plain", "v"))
    assert a != b
    code, _, err = run_cli(capsys, *common, "--query-samples", "0", "--out", str(tmp_path / "bad"))
    assert code == 2 and "--query-samples" in err and not (tmp_path / "bad").exists()


def test_query_samples_default_is_one_number():
    """The CLI's --query-samples default (a literal: the kinds import no torch at start-up), the library's QueryRefit
    default and the estimate's cost model must agree."""
    from surgery.estimate import QUERY_SAMPLES
    from surgery.kv.options import KVMergeOptions
    from surgery.fitting.refit import QueryRefit

    assert KVMergeOptions.model_fields["query_samples"].default == QueryRefit.samples == QUERY_SAMPLES
