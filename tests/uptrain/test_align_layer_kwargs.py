"""The align stage calls every decoder layer with the keyword arguments its own model passes it: a model whose layers
are of several types (sliding-window and global attention; a hybrid's mixers and attention) gives each type its own
mask, and a layer given another type's would not compute what it computes in the model."""

from __future__ import annotations

import torch
import transformers as tf

from surgery.testing import tiny_models as tm
from surgery.training.align import align


def test_each_student_layer_gets_the_mask_of_its_own_type(tmp_path):
    """The swa case: a student whose layer 0 is windowed (6 tokens) and layer 1 global, against a teacher with the
    same weights and every layer global. Layer 1 computes the teacher's layer 1 exactly (given its own mask, not
    layer 0's windowed one); layer 0 differs past the window."""
    src = tm.tiny("ministral", tmp_path / "m")
    student = tm.load(src)
    assert student.config.layer_types == ["sliding_attention", "full_attention"]
    teacher = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager",
                                                      layer_types=["full_attention"] * 2).eval()
    ids, held_out = tm.sample_ids(length=24), tm.sample_ids(seed=2, length=24)  # longer than the window
    record = align(student, teacher, ids, held_out, micro_batch=1, epochs=1, lr=1e-9, device="cpu",
                   log=lambda line: None)
    first, second = record["layers"]
    assert first["before"] > 1e-3 and second["before"] < 1e-12
