"""surgery.json keeps machine-local paths under one key, which the published view drops."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from surgery.testing import tiny_models as tm
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import MQAOptions
from surgery.checkpoint.record import local_source_folder, public_name, public_record, read_record, read_record_or_empty
from surgery.checkpoint.source import resolve_source


def test_public_record_holds_no_machine_paths(tmp_path):
    src = tmp_path / "my-llama"
    tm.make_tiny("llama", src)
    out = tmp_path / "out"
    convert_to_kv_heads(resolve_source(str(src)), out, MQAOptions())
    record = read_record(out)
    # The full record still finds the source on this machine (uptrain's default teacher, the card's columns).
    assert local_source_folder(record) == src
    public = json.dumps(public_record(record))
    for machine_path in (str(tmp_path), str(Path.home()), sys.prefix, os.getcwd()):
        assert machine_path not in public
    assert public_record(record)["source"]["spec"] == "my-llama"


def test_public_name_keeps_hub_ids_and_embedded_names(tmp_path):
    assert public_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert public_name("smollm2") == "smollm2"
    assert public_name(str(tmp_path / "models" / "x")) == "x"
    assert public_name("./relative/folder") == "folder"


def test_converted_side_files_hold_no_machine_keys(tmp_path):
    src = tmp_path / "src"
    tm.make_tiny("llama", src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"_model_name_or_path": str(tmp_path / "where")}))
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "is_local": True, "local_files_only": False,
                                                           "name_or_path": str(src), "model_max_length": 128}))
    out = tmp_path / "out"
    convert_to_kv_heads(resolve_source(str(src)), out, MQAOptions())
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok == {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128}
    assert "_model_name_or_path" not in json.loads((out / "config.json").read_text())


def test_gguf_dequantizing_time_is_reported_once(tmp_path, monkeypatch):
    import time

    import surgery.checkpoint.source as source

    def slow_dequantize(path, folder):
        time.sleep(0.2)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(source, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(source, "_write_dequantized", slow_dequantize)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-not-really")
    first, second = source.dequantize_gguf(gguf, str(gguf)), source.dequantize_gguf(gguf, str(gguf))
    assert first.folder == second.folder
    assert first.prepare_seconds >= 0.2 and second.prepare_seconds < 0.2


def _convert_each_kind(tmp_path):
    """Real outputs of every kind (the streamed ones on a tiny llama), as the CLI's library functions write them."""
    from surgery.kinds import get_kind
    from surgery.testing.tiny_models import tiny_tokenizer

    src = tmp_path / "src"
    tm.make_tiny("llama", src)
    tiny_tokenizer().save_pretrained(src)  # calibrated kinds read text
    source = resolve_source(str(src))
    outs = {}
    for name, opts in (("mqa", {}), ("gqa", {"kv_heads": 2}), ("talking-heads", {}),
                       ("switchhead", {"heads": 2, "experts": 4, "topk": 1, "calib_tokens": 64})):
        kind = get_kind(name)
        options = kind.options.model_validate(opts)
        outs[name] = tmp_path / name
        kind.convert(source, outs[name], options)
    return outs


def test_every_kind_writes_a_record_that_reads_back_typed_and_verifies(tmp_path):
    """write_record / read_record / verify_record are symmetric for what every kind writes."""
    from surgery.checkpoint.record import Record, verify_record

    for name, out in _convert_each_kind(tmp_path).items():
        record = read_record(out)
        typed = Record.model_validate(record)
        assert typed.kind == name and typed.source.model_type == "llama" and typed.source.shards_sha256
        assert set(typed.output_sha256) == {p.name for p in out.iterdir() if p.name != "surgery.json"}
        verify_record(out, record)  # nothing changed since the conversion


def test_verify_record_names_a_changed_file(tmp_path):
    import pytest

    from surgery.errors import SurgeryError
    from surgery.checkpoint.record import verify_record

    src = tmp_path / "src"
    tm.make_tiny("llama", src)
    convert_to_kv_heads(resolve_source(str(src)), tmp_path / "o", MQAOptions())
    record = read_record(tmp_path / "o")
    config = tmp_path / "o" / "config.json"
    config.write_text(config.read_text() + " ")  # one byte more
    with pytest.raises(SurgeryError, match="config.json does not match"):
        verify_record(tmp_path / "o", record)


def test_a_mistyped_record_is_one_error_naming_the_field(tmp_path):
    import pytest

    from surgery.errors import SurgeryError

    src = tmp_path / "src"
    tm.make_tiny("llama", src)
    convert_to_kv_heads(resolve_source(str(src)), tmp_path / "o", MQAOptions())
    path = tmp_path / "o" / "surgery.json"
    record = json.loads(path.read_text())
    for field, value, named in (("kind", [], "kind"), ("source", {"shards_sha256": {"a": 1}}, "source.shards_sha256"),
                                ("calibration", {"documents_sha256": "abc"}, "calibration.documents_sha256")):
        path.write_text(json.dumps({**record, field: value}))
        with pytest.raises(SurgeryError, match=rf"corrupt .*surgery.json: {named}"):
            read_record(tmp_path / "o")
        assert read_record_or_empty(tmp_path / "o") == {}  # for readers to whom broken means "nothing recorded"
    path.write_text(json.dumps(record))
    assert read_record_or_empty(tmp_path / "o") == read_record(tmp_path / "o") == record
    path.unlink()
    assert read_record_or_empty(tmp_path / "o") == {}
