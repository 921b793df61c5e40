"""Normal equations solved without copies: at 8B sizes one d x d float64 matrix is 134 MB, so the ridge term is
added in place and the LU factorisation overwrites the matrix it factors."""

from __future__ import annotations

import torch


def lu_in_place(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LU-factorise the square matrix `a` into its own storage (`a` is overwritten); returns (LU, pivots) for
    torch.linalg.lu_solve, the same factorisation torch.linalg.solve uses."""
    pivots = torch.empty(a.shape[-1], dtype=torch.int32, device=a.device)
    torch.linalg.lu_factor(a, out=(a, pivots))
    return a, pivots

