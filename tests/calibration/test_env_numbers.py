"""Environment variables read as numbers (issue 40) with the numeric options' strictness: `inf`, `nan`, negative
numbers and text are one line naming the variable, never an OverflowError or a silent clamp to 0."""

from __future__ import annotations

import pytest

from surgery.calibration.residual import DEFAULT_BUDGET, default_budget
from surgery.errors import SurgeryError
from surgery.progress import DEFAULT_SECONDS, interval_from_env


@pytest.mark.parametrize("name, read", [("SURGERY_RESIDUAL_RAM_MB", default_budget),
                                        ("SURGERY_PROGRESS_SECONDS", interval_from_env)])
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "-1", "1e400", "lots", "1e30"])
def test_bad_numbers_are_one_line_naming_the_variable(monkeypatch, name, read, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(SurgeryError, match=f"^{name} must be a number of .* not '{bad}'$"):
        read()


def test_good_numbers_and_unset_variables(monkeypatch):
    monkeypatch.setenv("SURGERY_RESIDUAL_RAM_MB", "1.5")
    assert default_budget() == int(1.5 * (1 << 20))
    monkeypatch.setenv("SURGERY_RESIDUAL_RAM_MB", "0")
    assert default_budget() == 0
    monkeypatch.setenv("SURGERY_PROGRESS_SECONDS", "0.5")
    assert interval_from_env() == 0.5
    for name in ("SURGERY_RESIDUAL_RAM_MB", "SURGERY_PROGRESS_SECONDS"):
        monkeypatch.setenv(name, " ")
    assert default_budget() == DEFAULT_BUDGET and interval_from_env() == DEFAULT_SECONDS
