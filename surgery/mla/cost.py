"""What `surgery convert --to mla` costs per decoder layer, for its dry run (surgery/estimate.py's model): the
floating-point work, the float64 matrices its fits hold at once, and the calibration activations it keeps.

The counts follow the code (surgery/mla/calibrate.py, factor.py), per layer, with T calibration tokens in windows
of W, hidden size H, h query and g K/V heads of d dims, latent rank R, D rope dims and F = 2 g d (the stacked
no-position keys and values):

- `frequency_scores_pass` (only when the conversion has a choice of rotary frequencies: `frequency_pass`): the
  layer input's second moments in float64 (2 T H^2), every frequency's query and key energies in complex128
  (`frequency_scores`: the heads' rows times Sigma), and the source layer's forward (attention and MLP, float32).
- `convert_pass`: the second moments again (on the converted stream), then the factorisation (`mla_layer`, float64:
  per kept frequency the RoRoPE split's complex products with Sigma; the query and o_proj metrics, their square
  roots, the weighted stack's products with Sigma and its eigendecomposition of size F), the query refit
  (`query_refit_products`: the source attention again, DeepSeek's queries and keys, the aligned merge's ideal
  queries per head at the sampled positions, the input Grams; an LU of H), DeepSeek's attention on
  the calibration windows (projections, latent expansion, full-square scores and values: float32), the source
  attention for the targets, the o_proj refit (the converted heads' Gram and cross products in float32, its LU and
  solve in float64), then the converted pass (DeepSeek's attention again: chunks are recomputed, not held), o_proj
  applied and the layer's MLP.
A complex multiply-add is four real ones (`COMPLEX`); a symmetric eigendecomposition with vectors costs about
9 n^3 (`EIGH`, as surgery/estimate.py counts the merge's); an LU 2/3 n^3.
"""

from __future__ import annotations

from ..estimate import QUERY_SAMPLES, QUERY_TOPK, CalibratedCost, Flops, LayerShape, attention_flops, mlp_flops

COMPLEX = 4  # real flops per complex flop of a matrix product (zgemm)
EIGH = 9  # flops of torch.linalg.eigh of an n x n matrix, per n^3


def _sizes(s: LayerShape, rank: int, rope: int) -> tuple[int, int, int, int, int, int, int]:
    return s.hidden, s.heads, s.kv_heads, s.head_dim, rank, rope, 2 * s.kv_heads * s.head_dim


def second_moment_flops(s: LayerShape, tokens: int) -> float:
    """float64 E[x x^T] of the layer input (calibrate._second_moments)."""
    return 2 * tokens * s.hidden**2


def frequency_score_flops(s: LayerShape) -> float:
    """float64 (complex) work of factor.frequency_scores: every query and key row's energy under Sigma."""
    H, h, g, d = s.hidden, s.heads, s.kv_heads, s.head_dim
    return COMPLEX * (h + g) * d * (H * H + H)


def factor_products(s: LayerShape, rank: int, rope: int) -> float:
    """float64 matrix products of factor.mla_layer (the RoRoPE split, the latent factorisation, the latent's
    energy): what torch's flop counter sees of it."""
    H, h, g, d, R, D, F = _sizes(s, rank, rope)
    split = D // 2 * COMPLEX * (2 * (h + g) * H * H + 2 * g * g * H + 2 * h * H + 2 * g * H)
    metrics = h * (2 * d * H * H + 2 * d * d * H) + h * 2 * d * d * H  # queries' under Sigma, o_proj's
    traces = 2 * g * (2 * d * H * H + 4 * d * d * H) + 2 * g * 4 * d**3  # each block's energy; square roots
    stacked = 2 * F * F * H + 2 * F * H * H + 2 * F * F * H + 2 * R * F * H + 2 * F * F * R  # M W, its Gram, A, B
    energy = 2 * R * H * H + 2 * R * H
    return split + metrics + traces + stacked + energy


def factor_decompositions(s: LayerShape, rank: int, rope: int) -> float:
    """float64 eigendecompositions of factor.mla_layer (not seen by torch's flop counter): the split's g x g per kept
    frequency, the metrics' square roots (d x d, 2 g of them) and the stack's (F x F)."""
    _, _, g, d, _, D, F = _sizes(s, rank, rope)
    return EIGH * (D // 2 * g**3 + 2 * g * d**3 + F**3)


def mla_attention_flops(s: LayerShape, rank: int, rope: int, tokens: int, window: int) -> float:
    """float32 work of calibrate.mla_attention: q_proj, kv_a, the latent's expansion (kv_b), full-square scores
    (nope + rope dims) and values."""
    H, h, _, d, R, D, _ = _sizes(s, rank, rope)
    projections = 2 * tokens * H * h * (d + D) + 2 * tokens * H * (R + D) + 2 * tokens * R * 2 * h * d
    return projections + 2 * tokens * window * h * (d + D) + 2 * tokens * window * h * d


def refit_products(s: LayerShape, tokens: int) -> float:
    """float32 products of the o_proj refit (merge.refit.refit_output): the heads' Gram and cross products."""
    hd = s.heads * s.head_dim
    return 2 * tokens * hd * hd + 2 * tokens * hd * s.hidden


def refit_solve(s: LayerShape) -> float:
    """float64 LU of the heads' Gram and its solve for every output row (not seen by torch's flop counter)."""
    hd = s.heads * s.head_dim
    return 2 / 3 * hd**3 + 2 * hd * hd * s.hidden


def query_refit_products(s: LayerShape, rank: int, rope: int, tokens: int, window: int, samples: int) -> Flops:
    """Matrix products of calibrate._refit_q (the aligned merge's `QueryFit` with one head per group): the source
    attention (its rotated queries and keys), DeepSeek's queries and keys (projections only), the input's Grams on
    all tokens and at the sampled positions, per head the key kernel phi A^-1 phi^T of every window and the ideal
    queries' products at the sampled positions (`ideal_queries`), the right-hand sides; float64: the prior's
    product with each head's rows."""
    H, h, _, d, R, D, _ = _sizes(s, rank, rope)
    windows = max(1, tokens // window)
    m = windows * min(samples, window)
    e = d + D + 1
    f = Flops()
    f.float32 += attention_flops(s, tokens, window)
    f.float32 += 2 * tokens * H * h * (d + D) + 2 * tokens * H * (R + D) + 2 * tokens * R * 2 * h * d
    f.float32 += 2 * tokens * H * H + 2 * m * H * H + 2 * m * H * h * (d + D)
    k = min(QUERY_TOPK, window)
    per_head = (2 * tokens * window * e + 4 * tokens * e * e + 2 * tokens * e * d  # kernel, Grams, cross moments
                + 2 * m * window * (d + 3 * e - 1) + 2 * m * (d * e + e * e + k * k))  # at the sampled positions
    f.float32 += h * per_head
    f.float64 += 2 * H * H * h * (d + D)
    return f


def query_refit_solve(s: LayerShape, rope: int) -> float:
    """float64 LU of the input's Gram and its solves for every head's rows (not seen by torch's flop counter)."""
    return 2 / 3 * s.hidden**3 + 2 * s.hidden**2 * s.heads * (s.head_dim + rope)


def mla_layer_products(s: LayerShape, rank: int, rope: int, tokens: int, window: int, frequency_pass: bool,
                       query_samples: int = 0) -> Flops:
    """One layer's matrix products (float32, float64): what torch's flop counter counts of `mla_layer_flops`."""
    f = Flops()
    if frequency_pass:
        f.float64 += second_moment_flops(s, tokens) + frequency_score_flops(s)
        f.float32 += attention_flops(s, tokens, window) + mlp_flops(s, tokens)  # the source layer's forward
    f.float64 += second_moment_flops(s, tokens) + factor_products(s, rank, rope)
    if query_samples:
        q = query_refit_products(s, rank, rope, tokens, window, query_samples)
        f.float32 += q.float32
        f.float64 += q.float64
    f.float32 += mla_attention_flops(s, rank, rope, tokens, window)
    f.float32 += attention_flops(s, tokens, window)  # the source attention: the refit's targets
    f.float32 += refit_products(s, tokens)
    f.float32 += mla_attention_flops(s, rank, rope, tokens, window)  # the converted pass: the MLA attention again
    f.float32 += 2 * tokens * s.heads * s.head_dim * s.hidden + mlp_flops(s, tokens)  # o_proj, the MLP
    return f


def mla_layer_flops(s: LayerShape, rank: int, rope: int, tokens: int, window: int, frequency_pass: bool,
                    query_samples: int = 0) -> Flops:
    """Work of one layer of the MLA conversion: both passes' products and the factorisations."""
    f = mla_layer_products(s, rank, rope, tokens, window, frequency_pass, query_samples)
    f.float64 += factor_decompositions(s, rank, rope) + refit_solve(s)
    if query_samples:
        f.float64 += query_refit_solve(s, rope)
    return f


def mla_fit_bytes(s: LayerShape, rank: int, rope: int, frequency_pass: bool, chunk_tokens: int) -> int:
    """float64 matrices alive at once, the largest of the layer's steps (as the code holds them): the second moments'
    sum (`chunk_tokens` rows cast at a time); the RoRoPE split (Sigma, its complex copy, the source attention, the
    keys being rewritten, the rope queries); the frequency scores (Sigma and its complex copy, the source attention,
    the complex rows and their products); the factorisation (Sigma, the source, the split's outputs, the block metrics
    M and M^-1, the stack W, M W, M W Sigma, its Gram, eigenvectors and workspace); assembling the weights (the
    factors, q_proj concatenated then scaled, kv_b gathered per head); the o_proj refit (the MLA weights, o_proj in
    float32, the Gram, the right-hand sides, the solution and its float32 copy)."""
    H, h, g, d, R, D, F = _sizes(s, rank, rope)
    hd = h * d
    sigma = 8 * H * H
    source = 8 * H * (2 * hd + 2 * g * d)
    split_out = 8 * D * H * (h + 1) + 8 * g * d * H
    moments = 3 * sigma + 8 * chunk_tokens * H
    split = 3 * sigma + source + split_out + 48 * (h + g) * H
    scores = 3 * sigma + source + 8 * (h + g) * d * H + 16 * hd * H if frequency_pass else 0
    factor = sigma + source + split_out + 8 * 2 * F * F + 8 * 3 * F * H + 8 * 4 * F * F
    assemble = sigma + source + split_out + 8 * (R * H + F * R) + 16 * h * (d + D) * H + 32 * hd * R
    weights = 8 * (h * (d + D) * H + (R + D) * H + 2 * hd * R + H * hd)
    refit = weights + 4 * H * hd + 8 * hd * hd + 16 * hd * H + 4 * hd * H
    query = weights + 8 * (2 * H * H + h * (d + D) * H) + 4 * h * (d + D) * H  # QueryFit's sums, the new q_proj
    return max(moments, split, scores, factor, assemble, refit, query)


def mla_activations(s: LayerShape, tokens: int, window: int, chunk: int) -> int:
    """float32 tensors held at once (calibrate.convert_pass): the residual stream [tokens, H] up to its spill budget
    (the rest is on disk), and one chunk's attention input, converted heads z, the source attention's output (the
    target) or the converted pass's attention output and layer output; the rotary cos/sin the layer calls carry.
    `chunk`: tokens per chunk (surgery/calibration/chunks.py)."""
    from ..calibration.residual import default_budget

    H, hd = s.hidden, s.heads * s.head_dim
    return min(4 * tokens * H, default_budget()) + 4 * chunk * (3 * H + hd + 2 * s.head_dim)


def mla_attention_memory(s: LayerShape, rank: int, rope: int, window: int, chunk: int) -> dict[str, int]:
    """One chunk's DeepSeek attention beyond the streaming model's scratch (which counts one [chunk, heads, window]
    map): its head dims differ (d + D for scores, d for values), which sends scaled_dot_product_attention to the
    math path on the CPU, holding the scores and their masked copy (then the probabilities) at once; and its float32
    queries, keys and values (q_proj's output, the expanded latent, the rotated and concatenated queries and keys,
    the math path's scaled copies)."""
    h, d = s.heads, s.head_dim
    return {"attention scores (math path)": 4 * chunk * h * window,
            "MLA queries and keys": 4 * chunk * (h * (5 * (d + rope) + 2 * d) + 3 * (rank + rope))}


def frequency_pass(config: dict, head_dim: int, rope: int) -> bool:
    """Whether the conversion scores the rotary frequencies first (convert_to_mla: more than one stride of the
    source's frequencies is DeepSeek's geometric progression, so there is a choice to make). Refuses, as the
    conversion does, a RoPE DeepSeek cannot follow."""
    from transformers import AutoConfig

    from .convert import config_frequencies, rope_strides

    layers = config.get("num_hidden_layers")
    per_layer = {k: v[:1] for k, v in config.items() if isinstance(v, list) and len(v) == layers}  # layer_types, ...
    one_layer = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
                                     | per_layer | {"num_hidden_layers": 1})  # the rotary module is all that is read
    return len(rope_strides(config_frequencies(one_layer, head_dim), rope)) > 1


def mla_cost(config: dict, rank: int, rope_dim: int | None, query_samples: int = QUERY_SAMPLES) -> CalibratedCost:
    """The conversion's cost model for `estimate_calibrated` (`--kv-rank rank --rope-dim rope_dim`, default head_dim),
    after the checks the conversion makes first (family, config, sizes: the dry run refuses what it would)."""
    from ..arch import spec_for
    from .convert import Shape, refuse_config
    from .families import mla_family
    from .refusals import KIND, REFUSES

    spec = spec_for(config, KIND, REFUSES)
    refuse_config(config, mla_family(spec.name))
    shape = Shape(spec, config, rank, rope_dim)
    rope = shape.rope_dim
    scored = frequency_pass(config, shape.rotary_dims, rope)
    return CalibratedCost(
        "mla", lambda s, tokens, window: mla_layer_flops(s, rank, rope, tokens, window, scored, query_samples),
        lambda s, chunk: mla_fit_bytes(s, rank, rope, scored, chunk),  # a chunk's rows are cast to float64 at once
        extra_memory=lambda s, tokens, window, chunk: mla_attention_memory(s, rank, rope, window, chunk),
        activations=mla_activations)
