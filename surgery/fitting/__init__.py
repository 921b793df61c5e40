"""The least-squares fits the calibrated conversions share (the aligned K/V merge and MLA): after a layer's
attention changes, its projections are refit so that its *output* matches the source's on calibration text.

- `rotary`: RoPE's structure, which head dimensions form a rotating pair (half-split or interleaved) and the
  rotation itself;
- `shape`: the head layout the refits share (query heads per K/V slot, input width, the groups a refit changes);
- `refit`: the query and output projections' refits, summed over calibration chunks.

What one layer's attention sees on the calibration tokens (the inputs these fits read) is
surgery.calibration.capture.
"""
