"""Hub ids resolve through huggingface_hub's cache (here pre-filled, offline), with revisions."""

from __future__ import annotations

import json
import shutil

from inprocess import assert_one_line_error, surgery

from surgery.testing import tiny_models as tm

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_hub_cache(cache, repo_id: str, folder) -> None:
    """The layout huggingface_hub itself writes: refs/<branch> -> commit, snapshots/<commit>/files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)


def test_convert_hub_id_from_cache(tmp_path):
    tm.make_tiny("qwen2", tmp_path / "src")
    fill_hub_cache(tmp_path / "hub", "someone/tiny-qwen2", tmp_path / "src")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    result = surgery("convert", "someone/tiny-qwen2", "--to", "gqa", "--kv-heads", "1", "--out", tmp_path / "o",
                     "--revision", COMMIT, env=env)
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "o" / "surgery.json").read_text())
    assert record["source"]["spec"] == "someone/tiny-qwen2" and record["source"]["revision"] == COMMIT
    assert json.loads((tmp_path / "o" / "config.json").read_text())["num_key_value_heads"] == 1

    missing = surgery("convert", "someone/tiny-qwen2", "--to", "mqa", "--out", tmp_path / "o2", "--revision",
                      "f" * 40, env=env)
    assert_one_line_error(missing, "someone/tiny-qwen2")
    assert not (tmp_path / "o2").exists()
