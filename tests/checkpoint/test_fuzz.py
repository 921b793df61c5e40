"""Property-based fuzzing of `surgery convert` on a tiny Llama checkpoint (issue 11).

Hypothesis mutates the safetensors header (entry types, dtypes, shapes, data_offsets, names, metadata, the header
length), the shard index, and config.json values, then runs `convert` in this process through `cli.main`. Every
case must end in one of two ways:
- exit 0 with an output that validates: every tensor reads back, config.json's head counts and the attention
  tensors agree, tensors outside attention are the source's bytes, and when the source loads in transformers the
  output loads too and gives finite logits;
- exit 2 with exactly one `surgery: error: ...` line and nothing written (no output folder, no temporary sibling).
`inspect` runs on every mutated source too: exit 0 with non-negative numbers, or one line and exit 2.
Never a traceback, another exit code, a hang (SIGALRM after HANG_SECONDS) or a partial output.

The runs are derandomized (the same cases every time) and bounded: EXAMPLES per property, about a minute in all on
the 2-core dev machine. `pytest -s` prints how many cases each property ran.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import tempfile
import warnings
from pathlib import Path

import pytest
from inprocess import run_cli as run_in_process
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from surgery.testing import tiny_models as tm

EXAMPLES = {"header": 150, "index": 60, "config": 120}
HANG_SECONDS = 30
RAN: dict[str, int] = {}

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

# --- strategies --------------------------------------------------------------------------------------------------

INTS = st.one_of(st.integers(-3, 70), st.integers(-(2**70), 2**70), st.sampled_from([2**63, 2**64 - 1, 10**12, 4096, 8192]))
LEAF = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)
DTYPES = ["F32", "F16", "BF16", "I32", "I64", "U8", "BOOL", "F64", "F8_E4M3", "Q4", "f32", ""]
ODD_NAMES = ["../x.safetensors", "../../other/model.safetensors", "/etc/passwd", "/tmp/model.safetensors", "",
             "sub/../model-00001-of-00002.safetensors", "missing.safetensors", ".", "model.safetensors",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "a\\..\\b", "config.json"]
ARGS = st.sampled_from([("--to", "mqa"), ("--to", "mqa"), ("--to", "gqa", "--kv-heads", "2"), ("--to", "gqa", "--kv-heads", "4"),
                        ("--to", "gqa", "--kv-heads", "3"), ("--to", "mqa", "--dtype", "bfloat16"),
                        ("--to", "gqa", "--kv-heads", "2", "--max-shard-size", "30KB")])


# --- the tiny source and running convert -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz") / "llama"
    tm.make_tiny("llama", folder)  # 8 heads, 4 K/V heads, head_dim 8, hidden 64, 2 layers
    return folder


@pytest.fixture(autouse=True)
def private_hash_cache(tmp_path, monkeypatch):
    import surgery.checkpoint.tensors

    monkeypatch.setattr(surgery.checkpoint.tensors._HashCache, "PATH", tmp_path / "cache" / "sha256.json")


@contextlib.contextmanager
def case_folder(pristine: Path):
    """A fresh work folder holding a copy of the source at work/src; removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        shutil.copytree(pristine, work / "src")
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_convert(capsys, src: Path, out: Path, args: tuple[str, ...]) -> tuple[int, str]:
    return run_cli(capsys, "convert", str(src), "--out", str(out), *args)[::2]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the command line run in this process, stopped after HANG_SECONDS."""
    return run_in_process(capsys, *argv, hang_seconds=HANG_SECONDS)


def check_inspect(capsys, src: Path) -> None:
    """`inspect` on the same source: a table of non-negative numbers, or one line and exit 2."""
    code, out, err = run_cli(capsys, "inspect", str(src), "--json")
    assert "Traceback" not in err, err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("surgery: error: "), err
        return
    assert code == 0, f"inspect exit {code}: {err}"
    stats = json.loads(out)[0]
    for key in ("layers", "heads", "kv_heads", "head_dim", "parameters", "kv_cache_bytes_per_token",
                "attention_macs_per_token"):
        assert isinstance(stats[key], int) and stats[key] >= 0, (key, stats[key])


def check_outcome(code: int, err: str, src: Path, out: Path, args: tuple[str, ...]) -> None:
    event(f"convert exit {code}")  # pytest --hypothesis-show-statistics shows how often each outcome came
    assert "Traceback" not in err, err
    siblings = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not siblings, f"temporary siblings left: {siblings}"
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("surgery: error: "), err
        assert not out.exists(), "refused, but an output was written"
        return
    assert code == 0, f"exit {code}: {err}"
    validate_output(src, out, args)


def validate_output(src: Path, out: Path, args: tuple[str, ...]) -> None:
    from surgery.checkpoint import validate
    from surgery.arch import qkv_layout, spec_for
    from surgery.checkpoint.tensors import CheckpointReader

    from safetensors import safe_open

    for file in sorted(src.glob("*.safetensors")):  # the reference reader accepts what convert accepted
        if file.name in _shards_used(src):
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    f.get_slice(key)
    config = json.loads((out / "config.json").read_text())
    validate.check_config_counts(config)
    spec = spec_for(config)
    heads, kv = spec.heads(config), spec.kv_heads(config)
    assert kv == (1 if "mqa" in args else int(args[args.index("--kv-heads") + 1]))
    with CheckpointReader(out) as reader, CheckpointReader(src) as source:
        validate.check_attention_tensors({n: t.shape for n, t in reader.tensors.items()}, spec, qkv_layout(spec, config).value,
                                       heads, kv, spec.head_dim(config), config.get(spec.hidden_key))
        assert set(reader.names()) == set(source.names())
        for name in reader.names():
            t = reader.load(name)
            if spec.match(name) is None and "--dtype" not in args:
                assert torch.equal(t.view(torch.uint8), source.load(name).view(torch.uint8)), name
    source_model = _load_or_none(src)
    if source_model is not None:
        model = tm.load(out)  # a loadable source must give a loadable output
        ids = tm.sample_ids()
        if torch.isfinite(tm.logits(source_model, ids)).all():
            assert torch.isfinite(tm.logits(model, ids)).all()


def _shards_used(src: Path) -> set[str]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"].values())
    return {"model.safetensors"}


def _load_or_none(folder: Path):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tm.load(folder)
    except Exception:
        return None


def record(kind: str) -> None:
    RAN[kind] = RAN.get(kind, 0) + 1


# --- safetensors headers -----------------------------------------------------------------------------------------


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def mutate_header(data, header: dict) -> object:
    names = [n for n in header if n != "__metadata__"]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        op = data.draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "entry", "delete", "add", "rename",
                                        "metadata", "whole", "permute", "shift", "shift", "swap"]), label="op")
        name = data.draw(st.sampled_from(names), label="tensor")
        entry = header.get(name)
        if op == "whole":
            return data.draw(JSON, label="header")
        if op == "metadata":
            header["__metadata__"] = data.draw(JSON, label="metadata")
        elif op == "delete":
            header.pop(name, None)
        elif op == "rename":
            new = data.draw(st.sampled_from(["model.layers.7.self_attn.k_proj.weight", "model.layers.0.self_attn.x_proj.weight",
                                             "model.layers.-1.self_attn.q_proj.weight", "__metadata__", ""]), label="new name")
            header[new] = header.pop(name, None)
        elif op == "add":
            header[data.draw(st.text(max_size=40), label="added")] = data.draw(JSON, label="added entry")
        elif op == "entry":
            header[name] = data.draw(JSON, label="entry")
        elif not isinstance(entry, dict):
            continue
        elif op == "drop":
            entry.pop(data.draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif op == "dtype":
            entry["dtype"] = data.draw(st.sampled_from(DTYPES) | JSON, label="dtype")
        elif op == "permute" and isinstance(entry.get("shape"), list):
            entry["shape"] = data.draw(st.permutations(entry["shape"]), label="permuted shape")
        elif op == "shift" and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2:
            delta = 4 * data.draw(st.integers(-64, 64), label="shift")
            entry["data_offsets"] = [o + delta if isinstance(o, int) else o for o in entry["data_offsets"]]
        elif op == "swap":
            other = header.get(data.draw(st.sampled_from(names), label="swap with"))
            if isinstance(other, dict) and "data_offsets" in other and "data_offsets" in entry:
                entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
        elif op == "shape":
            entry["shape"] = data.draw(st.lists(INTS, max_size=3) | JSON, label="shape")
        elif op == "offsets":
            begin, end = entry["data_offsets"]
            other = header[data.draw(st.sampled_from(names))]
            entry["data_offsets"] = data.draw(st.one_of(
                st.tuples(st.integers(-8, 8), st.integers(-8, 8)).map(lambda d: [begin + d[0] * 4, end + d[1] * 4]),
                st.just(other.get("data_offsets") if isinstance(other, dict) else None),
                st.lists(INTS, max_size=3), JSON), label="offsets")
    return header


@settings(max_examples=EXAMPLES["header"], **SETTINGS)
@given(data=st.data(), args=ARGS)
def test_fuzz_safetensors_header(pristine, capsys, data, args):
    record("header")
    with case_folder(pristine) as work:
        path = work / "src" / "model.safetensors"
        header, payload = read_header(path)
        header = mutate_header(data, header)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        length = data.draw(st.sampled_from([len(raw)] * 6 + [0, 7, len(raw) + 8, 2**63, 2**64 - 1]), label="length")
        cut = data.draw(st.sampled_from([0] * 6 + [1, 4, 4096, len(payload)]), label="truncate")
        path.write_bytes(struct.pack("<Q", length) + raw + payload[:len(payload) - cut])
        code, err = run_convert(capsys, work / "src", work / "out", args)
        check_outcome(code, err, work / "src", work / "out", args)
        check_inspect(capsys, work / "src")


# --- shard indexes -----------------------------------------------------------------------------------------------


def shard(folder: Path) -> dict:
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, members in files.items():
        save_file({n: state[n] for n in members}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, file))
    (folder / "model.safetensors").unlink()
    return {"metadata": {"total_size": 0}, "weight_map": weight_map}


@settings(max_examples=EXAMPLES["index"], **SETTINGS)
@given(data=st.data(), args=ARGS)
def test_fuzz_index(pristine, capsys, data, args):
    record("index")
    with case_folder(pristine) as work:
        src = work / "src"
        index = shard(src)
        outside = work / "other"
        outside.mkdir()
        shutil.copy(src / "model-00002-of-00002.safetensors", outside / "model.safetensors")
        wm = index["weight_map"]
        shard_names = sorted(set(wm.values()))
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            op = data.draw(st.sampled_from(["file", "file", "key", "weight_map", "whole", "drop"]), label="op")
            name = data.draw(st.sampled_from(sorted(wm)), label="tensor") if isinstance(wm, dict) and wm else None
            if op == "whole":
                index = data.draw(JSON, label="index")
            elif op == "weight_map" and isinstance(index, dict):
                index["weight_map"] = wm = data.draw(JSON | st.just(shard_names), label="weight_map")
            elif name is None:
                continue
            elif op == "file":
                value = data.draw(st.sampled_from(ODD_NAMES + [str(outside / "model.safetensors")]) | JSON, label="file")
                targets = [n for n in wm if wm[n] == wm[name]] if data.draw(st.booleans(), label="whole shard") else [name]
                for n in targets:
                    wm[n] = value
            elif op == "key":
                wm[data.draw(st.text(max_size=30), label="key")] = wm.pop(name)
            elif op == "drop":
                wm.pop(name)
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
        code, err = run_convert(capsys, src, work / "out", args)
        check_outcome(code, err, src, work / "out", args)
        check_inspect(capsys, src)


# --- config.json -------------------------------------------------------------------------------------------------

CONFIG_KEYS = ["num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers",
               "model_type", "auto_map", "architectures", "dtype", "tie_word_embeddings", "vocab_size"]
PLAUSIBLE = {
    "num_attention_heads": [1, 2, 4, 8, 16, 10**12, -4, 0],
    "num_key_value_heads": [1, 2, 3, 4, 8, 0, -1, None],
    "head_dim": [4, 8, 16, 0, -8, None],
    "hidden_size": [32, 64, 128, 0],
    "num_hidden_layers": [1, 2, 3, 0],
    "model_type": ["llama", "mistral", "qwen2", "gpt2", "gpt_neox", "bert", "nope", None],
    "auto_map": [{"AutoConfig": "configuration_x.XConfig"}, {"AutoConfig": "../evil.X"}, {"AutoConfig": "o/r--m.X"}, [], "x"],
}


@settings(max_examples=EXAMPLES["config"], **SETTINGS)
@given(data=st.data(), args=ARGS)
def test_fuzz_config(pristine, capsys, data, args):
    record("config")
    with case_folder(pristine) as work:
        src = work / "src"
        config = json.loads((src / "config.json").read_text())
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            key = data.draw(st.sampled_from(CONFIG_KEYS), label="key")
            if data.draw(st.integers(0, 9), label="whole?") == 0:
                config = data.draw(JSON, label="config")
                break
            value = data.draw(st.sampled_from(PLAUSIBLE.get(key, [None])) | JSON, label=key)
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (src / "config.json").write_text(json.dumps(config))
        code, err = run_convert(capsys, src, work / "out", args)
        check_outcome(code, err, src, work / "out", args)
        check_inspect(capsys, src)


def test_fuzz_case_counts():
    """Runs after the properties (file order): they ran their cases. `pytest -s` shows the counts."""
    print(f"\nfuzz cases run: {RAN} (total {sum(RAN.values())})")
    for kind, n in EXAMPLES.items():
        if kind in RAN:
            assert RAN[kind] >= n // 2, (kind, RAN[kind])
