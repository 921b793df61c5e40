"""Calibration for the calibrated conversions (`--merge aligned`, `--to switchhead`, `--to mla`, and `--to swa`'s
`--global-layers auto`), in one place.

- `text`: which text calibrates (kept apart from `surgery check`'s default evaluation text), tokenised into windows,
  with the record of what was read (`surgery.json` "calibration").
- `stream`: the source model layer by layer (sequential onloading): a skeleton on the meta device, the embeddings
  resident, one decoder layer at a time read from the checkpoint onto the device, calibrated and freed; the
  calibration activations stay on the device (or on the host when they do not fit). `estimate_peak_bytes` is its
  memory model.
- `capture`: what one decoder layer's attention sees on the calibration tokens (its input, the rotated queries and
  keys, the per-head outputs), recorded inside the streamed layer.
- `chunks`: how many calibration windows one chunk holds (sized by the model's width; `--calib-chunk`), the one
  rule the calibrated conversions and their cost models share.
- `layout`: a decoder layer's checkpoint tensors in the layout transformers keeps in memory (what streaming reads).
- `residual`: the calibration's residual streams, in memory up to a budget and in scratch files past it.
- `store`: each layer's converted tensors, kept from its calibration until the writer asks for them.
"""

from .stream import LayerStream, estimate_peak_bytes, open_stream
from .text import CalibrationText, calibration_text

__all__ = ["CalibrationText", "LayerStream", "calibration_text", "estimate_peak_bytes", "open_stream"]
