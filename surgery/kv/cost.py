"""What the aligned merge (surgery/kv/aligned/) costs, counted from the shapes and the algorithm: its float32 and
float64 work per decoder layer and the float64 matrices its fits hold at once, for `surgery.estimate`'s
`estimate_calibrated` (surgery/estimate.py says how counts become seconds and bytes). The counts:
the source attention on the converted stream (targets: once per refit pass over the chunks, as the pipeline recomputes
it instead of holding it), the converted attention (output refit, and again in the converted pass) and the converted
layer's MLP, in float32; the layer input's second moment; the query refit (ideal queries at sampled positions, its
normal equations); the output refit; and in float64 the group merges (surgery/kv/aligned/fit.py), once per group the
assignment search scores (surgery/kv/aligned/assign.py) plus once per final group. Each group merge costs about 2
d_in² D (s r + 4 s + 2) flops for s members and fully rotary heads (products with the d_in x d_in second moment
dominate).
"""

from __future__ import annotations

import math

from ..estimate import DEFAULT_WINDOW, QUERY_SAMPLES, Flops, LayerShape, attention_flops, mlp_flops
from .aligned.assign import exhaustive


def group_merge_flops(s: LayerShape, members: int) -> float:
    """float64 work of merging `members` K/V heads into one (surgery/kv/aligned/fit.py merge_group)."""
    if members <= 1:
        return 0.0
    din, d, r, rot = s.hidden + s.qkv_bias, s.head_dim, s.heads // s.kv_heads, s.rotary
    n = members
    # products with sigma, in rows of d_in: values (whitened stack, member energies, least-squares maps: 3n + 2
    # heads), keys' rotary part (n R rows, and the attached queries' energies n r R), keys' other dims (the queries'
    # metric n r (d - R), then the same linear merge as the values: (3n + 2)(d - R))
    sigma_products = 2 * din * din * (d * (3 * n + 2) + n * rot + n * r * d + (3 * n + 2) * (d - rot))
    stacked = 2 * (members * d) ** 2 * din + 9 * (members * d) ** 3  # whitened members' covariance and its eigh
    o_gram = 2 * members * r * s.hidden * d * d
    return sigma_products + stacked + o_gram


def head_grams_flops(s: LayerShape) -> float:
    """float64 work of the grouping search's per-layer products (surgery/kv/aligned/grams.py head_grams): the K, V and Q
    rows times sigma, the K and V Grams, the o_proj Grams and their square roots."""
    din, d, kv = s.hidden + s.qkv_bias, s.head_dim, s.kv_heads
    rows = 2 * kv * d + s.heads * d
    return 2 * din * din * rows + 2 * 2 * (kv * d) ** 2 * din + 2 * s.heads * s.hidden * d * d + 9 * kv * d**3


def group_score_flops(s: LayerShape, members: int) -> float:
    """float64 work of scoring one candidate group from those products (grams.group_loss): the whitened values'
    covariance and its eigenvalues (and the same for the non-rotary key dims)."""
    nd = members * s.head_dim
    rest = members * (s.head_dim - s.rotary)
    return 6 * nd**3 + 6 * rest**3 + 9 * members**3 * s.rotary


def search_flops(s: LayerShape, groups: int) -> float:
    """float64 work of the grouping search (--grouping similarity) for one layer; 0 when there is no choice."""
    scored = group_evaluations(s.kv_heads, groups)[:-groups]
    if not scored:
        return 0.0
    return head_grams_flops(s) + sum(group_score_flops(s, n) for n in scored)


def group_evaluations(kv_heads: int, groups: int, assign: bool = True) -> list[int]:
    """Sizes of the groups the assignment search scores for one layer, then the final groups (merged)."""
    n = kv_heads // groups
    final = [n] * groups
    if n == 1 or groups == 1 or not assign:
        return final
    if exhaustive(kv_heads, groups):
        return [n] * math.comb(kv_heads, n) + final  # every n-subset lies in some balanced partition
    scored, free = [], kv_heads  # greedy: each group grows from its first free head, trying every free head
    for _ in range(groups):
        free -= 1
        for size in range(2, n + 1):
            scored += [size] * free
            free -= 1
    return scored + final


def aligned_layer_flops(s: LayerShape, kv_out: int, tokens: int, window: int = DEFAULT_WINDOW,
                        assign: bool = True, query_samples: int = QUERY_SAMPLES, refit_values: bool = False) -> Flops:
    """Work of one layer of the aligned merge (local targets, query and output refits, optionally the value refit)."""
    f = Flops()
    grouped = s.kv_heads // kv_out > 1
    din, hd = s.hidden + s.qkv_bias, s.heads * s.head_dim
    windows = max(1, tokens // window)
    f.float32 += 2 * tokens * din * din  # second moment of the attention input
    if grouped:
        # the source attention on the converted stream (targets), recomputed in every refit pass over the chunks
        passes = 2 + refit_values  # the query refit's, the value refit's, the output refit's
        f.float32 += passes * attention_flops(s, tokens, window)
        # query refit: converted queries/keys, input Grams, ideal queries at sampled positions, right-hand sides
        samples = windows * min(query_samples, window)
        e = s.head_dim + 1
        f.float32 += 2 * tokens * din * (s.heads + s.kv_heads) * s.head_dim + 2 * tokens * din * din
        f.float32 += 2 * samples * din * din + 2 * samples * din * hd
        f.float32 += kv_out * 2 * windows * window * window * e + s.heads * 6 * samples * window * e
        f.float64 += 2 / 3 * din**3 + 2 * din * din * hd
        # output refit: the converted attention, its Gram and the solve
        f.float32 += attention_flops(s, tokens, window) + 2 * tokens * hd * hd + 2 * tokens * hd * s.hidden
        f.float64 += 2 / 3 * (hd + 1) ** 3 + 2 * hd * hd * s.hidden
        f.float32 += attention_flops(s, tokens, window)  # the converted pass runs the converted attention again
        if refit_values:  # per head: z = attention-weighted inputs at the sampled positions, their Gram, CG solves
            f.float32 += 2 * samples * window * din * s.heads + 2 * samples * din * din * s.heads
            f.float64 += 40 * 4 * s.heads * s.head_dim * din * din  # at most 40 CG steps (fewer when converged)
    else:
        f.float32 += attention_flops(s, tokens, window)
    f.float32 += mlp_flops(s, tokens)  # the converted pass through the layer's MLP
    f.float64 += sum(group_merge_flops(s, n) for n in group_evaluations(s.kv_heads, kv_out, assign=False))
    if assign:
        f.float64 += search_flops(s, kv_out)
    return f


def fit_bytes(s: LayerShape, refit_values: bool = False) -> int:
    """float64 matrices of the aligned merge's fits alive at once (not counted by the streaming model), as the code
    builds them (in place: no identity matrices, priors or transposed copies), and the source attention's copy."""
    din, hd, d = s.hidden + s.qkv_bias, s.heads * s.head_dim, s.hidden
    # the query refit: two input Grams (one becomes the LU) and the right-hand sides, float32 solution; the output
    # refit: the heads' Gram (its own LU), right-hand sides and solution, float32 copy. The merge before them holds
    # sigma and one group's heads in float64 (less).
    # each chunk's right-hand-side product in float32 and its float64 cast come on top of the query refit's sums
    query = 8 * (2 * din * din + hd * din) + 4 * hd * din + 12 * hd * din
    output = 8 * ((hd + 1) ** 2 + 2 * (hd + 1) * d) + 4 * (hd + 1) * d
    value = 8 * (s.heads * din * din + 2 * hd * din) if refit_values else 0  # every query head's input Gram
    # the source attention's float32 copy (the refits' targets, recomputed chunk by chunk) and the merged params
    # (source-shaped, float32) live through the layer
    source_copy = 4 * (din * (hd + 2 * s.kv_heads * s.head_dim) + d * hd)
    return max(query, output, value) + 2 * source_copy
