"""The streamed data path against hostile and careless inputs (issue 40): weights, file kinds, tampered positions,
large documents and single-file corpora, each refused in one line or handled with bounded memory."""

from __future__ import annotations

import pytest

from surgery.errors import SurgeryError
from surgery.uptrain.stream import parse_weights


def test_weights_whose_sum_overflows_are_normalised_not_zeroed():
    assert parse_weights("1e308,1e308", 2) == [0.5, 0.5]
    assert parse_weights([1.5e308, 0.5e308], 2) == pytest.approx([0.75, 0.25])
    with pytest.raises(SurgeryError, match="differ too much"):
        parse_weights("1e308,1e-320", 2)
