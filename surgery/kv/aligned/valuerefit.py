"""Least-squares refit of the merged values against the source's per-head attention outputs.

The value merge keeps the principal subspace of the members' values on raw tokens; what o_proj consumes is the
attention-weighted average of the values, z_hm = sum_n p_hmn x_n (p: the converted layer's attention). For every
group, the shared value rows V [D, d_in] are refit so that each of the group's heads, through its (folded) o_proj
slice o_h, reproduces that head's contribution to the source's attention output, on a sample of query positions:

    min_V  sum_{h in group} sum_m | o_h V z_hm - O_h u_hm |^2 + ridge |V - V0|^2_(B, Z)

(u_hm: the source head's output, O_h: the source o_proj slice). The normal equations sum_h B_h V Z_h = sum_h R_h
(B_h = o_h^T o_h, Z_h = sum_m z_hm z_hm^T) are a sum of Kronecker products, solved by conjugate gradients
preconditioned with the mean B and mean Z. The heads' contributions are matched one by one (an upper bound of the
output error); the output refit that follows fits o_proj on the whole output. A group of one head is not refit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...fitting.shape import RefitShape, refit_shape


@dataclass
class ValueRefit:
    samples: int = 128  # query positions per window
    ridge: float = 1e-3  # pull toward the merged values (relative to the normal operator's scale)
    iterations: int = 40  # conjugate-gradient steps (at most)
    tolerance: float = 1e-6  # relative residual at which conjugate gradients stop


def solve_kronecker_sum(b: torch.Tensor, z: torch.Tensor, rhs: torch.Tensor, x0: torch.Tensor, ridge: float,
                        iterations: int, tolerance: float) -> torch.Tensor:
    """X solving sum_h B_h X Z_h + c (X - x0) = rhs, by preconditioned conjugate gradients.

    b [H, p, p], z [H, q, q] symmetric PSD; rhs, x0 [p, q]; c = ridge * H * mean diag(B) * mean diag(Z) (a ridge
    toward x0 relative to the operator's scale). The preconditioner inverts H Bm X Zm + c X exactly (Bm, Zm: the
    mean B and Z) through their eigendecompositions.
    """
    heads = b.shape[0]
    bm, zm = b.mean(0), z.mean(0)
    c = ridge * heads * torch.diagonal(bm).mean().clamp_min(1e-30) * torch.diagonal(zm).mean().clamp_min(1e-30)
    db, ub = torch.linalg.eigh(bm)
    dz, uz = torch.linalg.eigh(zm)
    denom = heads * db.clamp_min(0)[:, None] * dz.clamp_min(0)[None, :] + c

    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("hij,jk,hkl->il", b, x, z) + c * x

    def precondition(r: torch.Tensor) -> torch.Tensor:
        return ub @ ((ub.T @ r @ uz) / denom) @ uz.T

    rhs = rhs + c * x0
    x = x0.clone()
    r = rhs - op(x)
    norm0 = rhs.norm().clamp_min(1e-30)
    y = precondition(r)
    p = y.clone()
    ry = (r * y).sum()
    for _ in range(iterations):
        if r.norm() <= tolerance * norm0:
            break
        ap = op(p)
        alpha = ry / (p * ap).sum().clamp_min(1e-300)
        x = x + alpha * p
        r = r - alpha * ap
        y = precondition(r)
        ry_new = (r * y).sum()
        p = y + (ry_new / ry.clamp_min(1e-300)) * p
        ry = ry_new
    return x


class ValueFit:
    """refit_values's normal equations (each head's Z_h and U_h Z_h products), accumulated window by window
    (positions drawn per window, in order): memory is one batch's tensors whatever the number of windows."""

    def __init__(self, shape: RefitShape, length: int, scaling: float, softcap: float | None, opts: ValueRefit,
                 generator: torch.Generator, device: torch.device):
        self.shape, self.length, self.scaling, self.softcap = shape, length, scaling, softcap
        self.opts, self.generator = opts, generator
        f64 = dict(dtype=torch.float64, device=device)
        self.z_gram = torch.zeros(shape.heads, shape.din, shape.din, **f64)
        self.uz = torch.zeros(shape.heads, shape.head_dim, shape.din, **f64)

    def add(self, x: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor, heads_src: torch.Tensor) -> None:
        """The next windows (refit_values's arguments for them)."""
        if not self.shape.fit:
            return
        s, length, dev = self.shape, self.length, x.device
        m = min(self.opts.samples, length)
        for i in range(x.shape[0]):
            positions = torch.randperm(length, generator=self.generator)[:m].sort().values.to(dev)
            visible = torch.arange(length, device=dev)[None, :] <= positions[:, None]  # [M, L]
            keys = k_cv[i].repeat_interleave(s.per_kv, 0).float().transpose(1, 2)
            logits = self.scaling * (q_cv[i][:, positions].float() @ keys)
            if self.softcap:
                logits = self.softcap * torch.tanh(logits / self.softcap)
            prob = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)  # [H, M, L]
            z = prob @ x[i].float()  # [H, M, din]
            u = heads_src[i][positions].float().reshape(m, s.heads, s.head_dim).transpose(0, 1)  # [H, M, D]
            self.z_gram += (z.transpose(1, 2) @ z).double()
            self.uz += (u.transpose(1, 2) @ z).double()

    def solve(self, v_rows: torch.Tensor, o_cv: torch.Tensor, o_src: torch.Tensor) -> torch.Tensor:
        """New v_proj rows [KV*D, d_in]; o_cv [d, H*D] the converted (folded) o_proj, o_src the source's."""
        s = self.shape
        if not s.fit:
            return v_rows
        rows = v_rows.double().reshape(s.kv, s.head_dim, s.din).clone()
        o_h = o_cv.double().reshape(-1, s.heads, s.head_dim).transpose(0, 1)  # [H, d, D]
        os_h = o_src.double().reshape(-1, s.heads, s.head_dim).transpose(0, 1)
        b_all = o_h.transpose(1, 2) @ o_h  # [H, D, D]
        cross = o_h.transpose(1, 2) @ os_h  # [H, D, D]: o_h^T O_h
        for members in s.fit:
            hs = [j * s.per_kv + h for j in members for h in range(s.per_kv)]
            rhs = (cross[hs] @ self.uz[hs]).sum(0)  # [D, din]
            new = solve_kronecker_sum(b_all[hs], self.z_gram[hs], rhs, rows[members[0]], self.opts.ridge,
                                      self.opts.iterations, self.opts.tolerance)
            for j in members:
                rows[j] = new
        return rows.reshape(s.kv * s.head_dim, s.din).float()


@torch.no_grad()
def refit_values(x: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor, heads_src: torch.Tensor,
                 groups: list[list[int]], scaling: float, softcap: float | None, v_rows: torch.Tensor,
                 o_cv: torch.Tensor, o_src: torch.Tensor, opts: ValueRefit, generator: torch.Generator) -> torch.Tensor:
    """New v_proj rows [KV*D, d_in] (source-shaped: every slot of a group holds the group's refit value; `ValueFit`
    over all the windows at once).

    x [N, L, d_in] converted attention input (augmented when v has a bias); q_cv [N, H, L, D], k_cv [N, KV, L, D]
    the converted layer's rotated queries and keys on x (source-shaped); heads_src [N, L, H*D] what entered the
    source's o_proj on the same inputs; o_cv [d, H*D] the converted (folded) o_proj, o_src the source's.
    """
    fit = ValueFit(refit_shape(x, q_cv, k_cv, groups), q_cv.shape[2], scaling, softcap, opts, generator, x.device)
    fit.add(x, q_cv, k_cv, heads_src)
    return fit.solve(v_rows, o_cv, o_src)
