"""`--retrieval-mix P`: a fraction P of the training windows replaced by synthetic retrieval examples built from the
window's own text. The examples and the choice of windows live below training (surgery/retrieval_mix.py), where
calibration's `--calib-retrieval-mix` builds the same ones; this module is what training imports of it."""

from __future__ import annotations

from ..retrieval_mix import DEPTHS, TASKS, RetrievalMix, mixed, mixed_weighted

__all__ = ["DEPTHS", "TASKS", "RetrievalMix", "mixed", "mixed_weighted"]
