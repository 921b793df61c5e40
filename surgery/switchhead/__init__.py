"""SwitchHead attention (Csordás et al. 2023, arXiv 2312.07987): conversion of pretrained checkpoints into
head-clustered experts with σ-MoE routers, and the modeling code (`modeling_switchhead.py`,
`configuration_switchhead.py`) that is copied into every converted checkpoint."""

from .convert import convert_to_switchhead

__all__ = ["convert_to_switchhead"]
