"""Multi-head latent attention (DeepSeek-V2/V3): conversion of Llama-like checkpoints into plain `deepseek_v3`
checkpoints (surgery/mla/convert.py), from the per-layer factorisation in surgery/mla/factor.py."""

__all__ = ["convert_to_mla"]


def __getattr__(name: str):
    """`convert_to_mla` on first use: importing the package (e.g. its torch-free `refusals`) does not load torch."""
    if name == "convert_to_mla":
        from .convert import convert_to_mla

        return convert_to_mla
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
