"""`lr_at` against transformers' cosine-with-min-lr schedule: the cosine part is the same function, the warmup is
transformers' one step later (so `lr_at` keeps its own warmup: step 0 trains at lr / warmup, not at 0)."""

import math
from types import SimpleNamespace

import pytest
from transformers.optimization import _get_cosine_schedule_with_warmup_lr_lambda

from surgery.training.optimizer import lr_at


@pytest.mark.parametrize("warmup,steps,ratio", [(4, 20, 0.1), (1, 7, 0.0), (10, 10, 0.5)])
def test_lr_at_against_transformers(warmup, steps, ratio):
    o = SimpleNamespace(lr=3e-4, warmup=warmup, steps=steps, min_lr_ratio=ratio)  # what lr_at reads
    theirs = lambda step: o.lr * _get_cosine_schedule_with_warmup_lr_lambda(  # noqa: E731
        step, num_warmup_steps=warmup, num_training_steps=steps, num_cycles=0.5, min_lr_rate=ratio)
    for step in range(steps):
        if step < warmup:
            assert math.isclose(lr_at(step, o), theirs(step + 1), rel_tol=1e-12)
            assert lr_at(step, o) > theirs(step)  # transformers' warmup is one step behind (0 at step 0)
        else:
            assert math.isclose(lr_at(step, o), theirs(step), rel_tol=1e-12)
    assert lr_at(0, o) > 0 == theirs(0)
