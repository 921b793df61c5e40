"""One layer's MLA weights from a Llama-like attention layer and its input's second moments (pure tensor math).

The source head h (of K/V group g) scores `q_h . rot(k_g)`: every source dimension rotates. DeepSeek's attention
scores `q_nope_h . k_nope_h + q_rope_h . rot(k_rope)` with ONE rope key shared by every head. Per kept RoPE frequency
f (a complex pair), the K/V groups' keys k_f in C^kv are split, as TransMLA's RoRoPE does, into their principal
complex direction (weighted by how much each group's queries read it) and a residual:
    k_g,f = a_g z_f + r_g,f,    z_f = sum_g conj(b_g) k_g,f    (b = W^1/2 v, a = W^-1/2 v, v the top eigenvector)
z_f is the shared rope key (it keeps its rotation exactly: a complex scalar commutes with RoPE), the rope query of
head h is conj(a_g) q_h,f, and the residual r_g (with every frequency not kept) becomes head h's no-position key
against the unrotated source query q_h. With one K/V head (MQA) the residual at kept frequencies is zero: exact.

K-nope (the residuals) and V of every group are then factored jointly through one latent of rank R (CARE-style):
minimise E || M (W - B A) x ||^2 over rank-R products B A, where x has second moments Sigma (the calibration
activations), W stacks the residual keys and the values, and M weighs each group's key rows by the second moments
of the queries that read them and each group's value rows by o_proj's metric, each block normalised to the same
total (relative errors of logits and outputs count alike). Solution: U_R, the top R eigenvectors of
M W Sigma W^T M; A = U_R^T M W, B = M^-1 U_R.

Retrieval weights (`FitWeights`, from surgery/mla/retrieval.py; None: every head and row weighs the same, the
computation above unchanged). Each query head h weighs a_h = 1 + B x its retrieval score in the two places the
factorisation reads the queries: its energy in the rope split's per-group weight (so the shared rope key leans toward
the retrieval heads' keys) and its term of the group's key metric sum_h a_h q_h Sigma_q q_h^T (and o_proj's value
metric sum_h a_h o_h o_h^T), so the latent's rank goes to the directions the retrieval heads read and write; the
blocks' normalisation then shares the fixed total between groups by these weighted metrics. The statistics can
up-weight the retrieval examples' rows: Sigma_k (keys' and values' inputs: the needle positions counted W times)
is the data term of both fits, Sigma_q (queries' inputs: the answer positions counted W times) their query
metrics; the latent's scale (kv_a_layernorm's linear regime) stays on the plain Sigma of every token.

Everything runs on the device of its inputs (the calibration's, CUDA included): every tensor made here is made there.
On CUDA, eigh may return eigenvectors of other signs (phases) than the CPU's; the attention function is the same (B A
and the rope query-key products do not depend on them), so conversions made on two devices compare by logits, not
by weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SourceAttention:
    """A Llama-like layer's attention weights (float64): q [h*d, H], k/v [kv*d, H], o [H, h*d]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int


@dataclass
class MLAWeights:
    """DeepSeek-V3 attention tensors of one layer (float64): q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj, and the losses of the two approximations (relative, in their metrics)."""

    q_proj: torch.Tensor
    kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor
    o_proj: torch.Tensor
    rope_loss: float
    latent_loss: float

    def to(self, device: torch.device | str) -> "MLAWeights":
        tensors = (self.q_proj, self.kv_a, self.kv_a_norm, self.kv_b, self.o_proj)
        return MLAWeights(*(t.to(device) for t in tensors), self.rope_loss, self.latent_loss)


@dataclass(frozen=True)
class FitWeights:
    """One layer's retrieval weighting of the factorisation: each query head's weight [h] (None: 1 each), and the
    second moments of the keys' and the queries' inputs with the retrieval rows up-weighted (None: the plain sigma)."""

    heads: torch.Tensor | None = None
    key_sigma: torch.Tensor | None = None
    query_sigma: torch.Tensor | None = None


def pair_rows(head_dim: int, pairs: str, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the real and imaginary part of each rotary frequency inside one head: (i, i + d/2) or (2i, 2i+1)."""
    i = torch.arange(head_dim // 2, device=device)
    return (i, i + head_dim // 2) if pairs == "half" else (2 * i, 2 * i + 1)


def _heads(w: torch.Tensor, n: int, d: int) -> torch.Tensor:
    return w.reshape(n, d, -1)


def _complex(rows: torch.Tensor, re: torch.Tensor, im: torch.Tensor) -> torch.Tensor:
    """[..., d, H] real rows -> [..., d/2, H] complex (one per frequency)."""
    return torch.complex(rows[..., re, :], rows[..., im, :])


def frequency_scores(src: SourceAttention, sigma: torch.Tensor, pairs: str) -> torch.Tensor:
    """Per source frequency, its contribution to the attention logits (MHA2MLA's 2-norm score): sum over heads of
    sqrt(E|q_h,f|^2) sqrt(E|k_g,f|^2), normalised to sum 1 over the layer."""
    h, kv, d = src.heads, src.kv_heads, src.head_dim
    re, im = pair_rows(d, pairs, sigma.device)
    qc, kc = _complex(_heads(src.q, h, d), re, im), _complex(_heads(src.k, kv, d), re, im)
    s = sigma.to(torch.complex128)
    q_energy = torch.einsum("hfi,ij,hfj->hf", qc, s, qc.conj()).real.clamp_min(0).sqrt()
    k_energy = torch.einsum("gfi,ij,gfj->gf", kc, s, kc.conj()).real.clamp_min(0).sqrt()
    score = (q_energy * k_energy.repeat_interleave(h // kv, 0)).sum(0)
    return score / score.sum().clamp_min(1e-300)


def _rope_split(qc_f: torch.Tensor, kc_f: torch.Tensor, sigma: torch.Tensor, group: torch.Tensor,
                weights: FitWeights | None = None):
    """One frequency: qc_f [h, H], kc_f [kv, H] complex rows -> (rope key row [H], rope query rows [h, H], residual
    key rows [kv, H], relative loss). `sigma`: the keys' input moments; `weights`: the heads' weights and the queries'
    input moments."""
    s = sigma.to(torch.complex128)
    cov = kc_f @ s @ kc_f.conj().T  # E[k k^H]
    qs = s if weights is None or weights.query_sigma is None else weights.query_sigma.to(torch.complex128)
    q_energy = torch.einsum("hi,ij,hj->h", qc_f, qs, qc_f.conj()).real
    if weights is not None and weights.heads is not None:
        q_energy = q_energy * weights.heads.to(q_energy)
    weight = torch.zeros(kc_f.shape[0], dtype=torch.float64, device=kc_f.device).index_add_(0, group, q_energy)
    weight = weight + 1e-12 * weight.max().clamp_min(1e-300)
    root = weight.sqrt().to(torch.complex128)
    vals, vecs = torch.linalg.eigh(root[:, None] * cov * root[None, :])
    v = vecs[:, -1]
    b, a = root * v, v / root
    z = b.conj() @ kc_f  # shared rope key [H]
    residual = kc_f - a[:, None] * z[None, :]
    total = vals.clamp_min(0).sum()
    loss = float((total - vals[-1].clamp_min(0)) / total) if total > 0 else 0.0
    return z, a.conj()[group][:, None] * qc_f, residual, loss


def split_rope(src: SourceAttention, sigma: torch.Tensor, kept: list[int], pairs: str,
               weights: FitWeights | None = None):
    """The rope key [D_r, H] (DeepSeek's interleaved pairs), rope queries [h, D_r, H], the no-position keys
    [kv, d, H] (source layout) and the mean relative loss of the shared rope key over the kept frequencies."""
    h, kv, d = src.heads, src.kv_heads, src.head_dim
    re, im = pair_rows(d, pairs, sigma.device)
    q, k = _heads(src.q, h, d), _heads(src.k, kv, d).clone()
    f64 = dict(dtype=torch.float64, device=sigma.device)
    group = torch.arange(h, device=sigma.device) // (h // kv)
    rope_k = torch.zeros(2 * len(kept), src.k.shape[1], **f64)
    rope_q = torch.zeros(h, 2 * len(kept), src.q.shape[1], **f64)
    losses = []
    for i, f in enumerate(kept):
        z, qr, residual, loss = _rope_split(torch.complex(q[:, re[f]], q[:, im[f]]),
                                            torch.complex(k[:, re[f]], k[:, im[f]]), sigma, group, weights)
        rope_k[2 * i], rope_k[2 * i + 1] = z.real, z.imag
        rope_q[:, 2 * i], rope_q[:, 2 * i + 1] = qr.real, qr.imag
        k[:, re[f]], k[:, im[f]] = residual.real, residual.imag
        losses.append(loss)
    return rope_k, rope_q, k, (sum(losses) / len(losses) if losses else 0.0)


def _root(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root of a PSD matrix and its inverse (with a small ridge for singular ones)."""
    vals, vecs = torch.linalg.eigh(m)
    vals = vals.clamp_min(0) + 1e-10 * vals.abs().max().clamp_min(1e-300)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs / vals.sqrt()) @ vecs.T


def factor_latent(nope_k: torch.Tensor, src: SourceAttention, sigma: torch.Tensor, rank: int,
                  weights: FitWeights | None = None):
    """Joint rank-`rank` factorisation of the no-position keys [kv, d, H] and values: A [R, H], B [(2*kv*d), R]
    (rows: every group's keys, then every group's values) and the relative loss in the weighting metric. `sigma`:
    the keys' and values' input moments; `weights`: the heads' weights in the metrics and the queries' moments."""
    h, kv, d = src.heads, src.kv_heads, src.head_dim
    per = h // kv
    q, o = _heads(src.q, h, d), src.o.T.reshape(h, d, -1)
    qs = sigma if weights is None or weights.query_sigma is None else weights.query_sigma
    a = None if weights is None or weights.heads is None else [float(v) for v in weights.heads]
    blocks, inverses, rows = [], [], []
    for part in ("k", "v"):
        metrics = []
        for g in range(kv):
            heads = range(g * per, (g + 1) * per)
            if part == "k":
                metric = (sum(q[j] @ qs @ q[j].T for j in heads) if a is None else
                          sum(a[j] * (q[j] @ qs @ q[j].T) for j in heads))
                w = nope_k[g]
            else:
                metric = (sum(o[j] @ o[j].T for j in heads) if a is None else
                          sum(a[j] * (o[j] @ o[j].T) for j in heads))
                w = _heads(src.v, kv, d)[g]
            metrics.append((metric, w))
        total = sum(float(torch.trace(m @ w @ sigma @ w.T)) for m, w in metrics)
        scale = 1.0 / max(total, 1e-300)
        for metric, w in metrics:
            root, inv = _root(metric * scale)
            blocks.append(root)
            inverses.append(inv)
            rows.append(w)
    m, m_inv, w = torch.block_diag(*blocks), torch.block_diag(*inverses), torch.cat(rows)
    y = m @ w
    vals, vecs = torch.linalg.eigh(y @ sigma @ y.T)
    u = vecs[:, -rank:].flip(1)
    total = vals.clamp_min(0).sum()
    loss = float((total - vals[-rank:].clamp_min(0).sum()) / total) if total > 0 else 0.0
    return u.T @ y, m_inv @ u, loss


def mla_layer(src: SourceAttention, sigma: torch.Tensor, kept: list[int], pairs: str, rank: int,
              source_scaling: float, eps: float, latent_energy: float = 1e-4,
              rope_dim: int | None = None, weights: FitWeights | None = None) -> MLAWeights:
    """DeepSeek-V3 attention weights for one layer (see the module docstring).

    The softmax scale (d + D_r)^-0.5 that DeepSeek applies is folded into the queries (the source used
    `source_scaling`). kv_a_layernorm (RMSNorm, fixed epsilon `eps`) is made linear: the latent rows are scaled so
    that its mean square is `latent_energy` x eps on average over the calibration tokens, where the norm divides by
    sqrt(eps + mean square) ~ sqrt(eps) (relative error ~ latent_energy / 2 per token, proportionally more on tokens
    with a larger latent); its weight sqrt(eps)/scale restores the latent's scale.

    `rope_dim` (default 2 x the kept frequencies): the model's rope dims, of which the rows past the kept
    frequencies are zero: a layer without RoPE (SmolLM3's no_rope_layers) keeps none, every key dimension goes
    through the latent and its rope query and key are zero.

    `weights` (None: none): the retrieval weighting of both fits (the module docstring); the latent's scale reads
    the plain `sigma`."""
    h, kv, d = src.heads, src.kv_heads, src.head_dim
    key_sigma = sigma if weights is None or weights.key_sigma is None else weights.key_sigma
    rope_k, rope_q, nope_k, rope_loss = split_rope(src, key_sigma, kept, pairs, weights)
    a, b, latent_loss = factor_latent(nope_k, src, key_sigma, rank, weights)
    d_rope = 2 * len(kept) if rope_dim is None else rope_dim
    if d_rope > rope_k.shape[0]:  # zero rope rows: no position for this layer's keys
        rope_k = torch.cat([rope_k, rope_k.new_zeros(d_rope - rope_k.shape[0], rope_k.shape[1])])
        rope_q = torch.cat([rope_q, rope_q.new_zeros(h, d_rope - rope_q.shape[1], rope_q.shape[2])], dim=1)
    fold = source_scaling / (d + d_rope) ** -0.5
    q = torch.cat([_heads(src.q, h, d), rope_q], dim=1) * fold  # [h, d + D_r, H]
    energy = float(torch.einsum("ri,ij,rj->", a, sigma, a)) / rank
    scale = (latent_energy * eps / energy) ** 0.5 if energy > 0 else 1.0
    group = torch.arange(h, device=sigma.device) // (h // kv)
    bk, bv = b[: kv * d].reshape(kv, d, rank), b[kv * d:].reshape(kv, d, rank)
    kv_b = torch.cat([bk[group], bv[group]], dim=1)  # [h, d + d, R]
    return MLAWeights(q.reshape(-1, q.shape[-1]), torch.cat([a * scale, rope_k]),
                      torch.full((rank,), eps**0.5 / scale, dtype=torch.float64, device=sigma.device), kv_b.reshape(-1, rank),
                      src.o.clone(), rope_loss, latent_loss)
