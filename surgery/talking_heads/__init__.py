"""Talking-heads attention (Shazeer et al. 2020): conversion of pretrained checkpoints, and the modeling code
(`modeling_talking_heads.py`, `configuration_talking_heads.py`) that is copied into every converted checkpoint."""

__all__ = ["convert_to_talking_heads"]


def __getattr__(name: str):
    """`convert_to_talking_heads` on first use: importing the package (e.g. its torch-free `refusals`) does not load torch."""
    if name == "convert_to_talking_heads":
        from .convert import convert_to_talking_heads

        return convert_to_talking_heads
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
