"""Multi-head latent attention (DeepSeek-V2/V3): conversion of Llama-like checkpoints into plain `deepseek_v3`
checkpoints (surgery/mla/convert.py), from the per-layer factorisation in surgery/mla/factor.py."""

from .convert import convert_to_mla

__all__ = ["convert_to_mla"]
