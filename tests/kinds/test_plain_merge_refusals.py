"""Options that only the aligned merge reads, given with a plain merge (issue 40): refused in one line on the command
line and in a recipe, as other kinds refuse theirs, instead of silently doing nothing."""

from __future__ import annotations

import pytest

from surgery.errors import SurgeryError
from surgery.kinds import options_for


@pytest.mark.parametrize("name, value, flag", [("calib_chunk", 2, "--calib-chunk"), ("calib", ["pydoc"], "--calib"),
                                               ("calib_tokens", 512, "--calib-tokens"),
                                               ("calib_window", 64, "--calib-window"),
                                               ("query_samples", 8, "--query-samples"),
                                               ("grouping", "consecutive", "--grouping")])
@pytest.mark.parametrize("merge", ["mean", "first", "random"])
def test_aligned_only_options_are_refused_with_a_plain_merge(name, value, flag, merge):
    with pytest.raises(SurgeryError, match=f"does nothing for the {merge} merge"):
        options_for("mqa", merge=merge, **{name: value})
    assert getattr(options_for("mqa", merge="aligned", **{name: value}), name) == value
    assert options_for("gqa", kv_heads=2, merge=merge).merge == merge  # nothing given: accepted


def test_the_command_line_names_the_flag(cli, tmp_path):
    code, _, err = cli("convert", "pydoc-tiny-does-not-matter", "--to", "mqa", "--calib-chunk", "2", "--out",
                       str(tmp_path / "o"))
    assert code == 2 and err.strip().splitlines() == [
        "surgery: error: --calib-chunk does nothing for the mean merge, which reads no calibration text (use --merge "
        "aligned, or leave --calib-chunk out)"], err
    assert not (tmp_path / "o").exists()
