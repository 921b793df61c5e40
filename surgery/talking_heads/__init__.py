"""Talking-heads attention (Shazeer et al. 2020): conversion of pretrained checkpoints, and the modeling code
(`modeling_talking_heads.py`, `configuration_talking_heads.py`) that is copied into every converted checkpoint."""

from .convert import convert_to_talking_heads

__all__ = ["convert_to_talking_heads"]
