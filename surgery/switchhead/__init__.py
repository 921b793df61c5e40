"""SwitchHead attention (Csordás et al. 2023, arXiv 2312.07987): conversion of pretrained checkpoints into
head-clustered experts with σ-MoE routers, and the modeling code (`modeling_switchhead.py`,
`configuration_switchhead.py`) that is copied into every converted checkpoint."""

__all__ = ["convert_to_switchhead"]


def __getattr__(name: str):
    """`convert_to_switchhead` on first use: importing the package (e.g. its torch-free `refusals`) does not load torch."""
    if name == "convert_to_switchhead":
        from .convert import convert_to_switchhead

        return convert_to_switchhead
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
