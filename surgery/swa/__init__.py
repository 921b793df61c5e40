"""`surgery convert SRC --to swa`: most layers turned into sliding-window attention, the others kept global, written
as a standard checkpoint (per-layer `layer_types` and `sliding_window`) that transformers and vLLM load with no
custom code. The weights are copied unchanged; only the config says which layers see a window.

- `layers.py`   which layers stay global: a count (evenly spaced), a list, or `auto` (from `score.py`);
- `score.py`    `auto`'s calibration: each layer's attention mass beyond the window at long context;
- `convert.py`  the target config and the streamed copy.
"""

from .convert import convert_to_swa

__all__ = ["convert_to_swa"]
