"""Hostile and broken checkpoints (issue 11, sections 2-4 for convert and inspect): one line on stderr, exit 2,
nothing written — or, where the input is fine (a hub cache's symlinked shards), a correct output.

Most cases run `cli.main` in-process (fast); signals and hangs run a real subprocess."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inprocess import run_cli as run_in_process
import torch
from safetensors.torch import load_file, save_file

from surgery.testing import tiny_models as tm

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_hash_cache(tmp_path, monkeypatch):
    """Each test gets its own sha256 cache (never the user's ~/.cache)."""
    import surgery.checkpoint.tensors

    monkeypatch.setattr(surgery.checkpoint.tensors._HashCache, "PATH", tmp_path / "cache" / "sha256.json")
    return tmp_path / "cache" / "sha256.json"


@pytest.fixture
def run_cli(capsys):
    """Run the command line in this process: returns (exit code, stdout, stderr)."""
    return lambda *args: run_in_process(capsys, *args)


def assert_one_line(result, *fragments: str, absent: tuple[str, ...] = ()) -> str:
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("surgery: error: "), err
    for f in fragments:
        assert f in lines[0], lines[0]
    for f in absent:
        assert f not in lines[0], lines[0]
    return lines[0]


def nothing_written(parent: Path, out_name: str = "out") -> None:
    assert not (parent / out_name).exists()
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{out_name}.")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    tm.make_tiny("llama", folder)  # 8 heads, 4 K/V heads, head_dim 8, hidden 64, 2 layers
    return folder


@pytest.fixture
def src(tiny, tmp_path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(tiny, folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    path.write_text(json.dumps(config))


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path: Path, header, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def digest_tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def shard(folder: Path) -> None:
    """Turn the single-file checkpoint into two shards plus an index."""
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, members in files.items():
        save_file({n: state[n] for n in members}, folder / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in members})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --- section 2: paths and data loss ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad_name", ["../other/model.safetensors", "/ABS/model.safetensors", "a/../../x.safetensors"])
def test_index_naming_a_file_outside_the_folder_is_refused(src, tmp_path, run_cli, bad_name):
    shard(src)
    outside = tmp_path / "other"
    outside.mkdir()
    shutil.copy(src / "model-00002-of-00002.safetensors", outside / "model.safetensors")
    bad_name = bad_name.replace("/ABS", str(outside))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: (bad_name if f.endswith("00002.safetensors") else f) for n, f in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "outside the checkpoint folder")
    assert_one_line(run_cli("inspect", src), "outside the checkpoint folder")
    nothing_written(tmp_path)


def test_index_weight_map_that_is_a_list_is_refused(src, tmp_path, run_cli):
    shard(src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = sorted(set(index["weight_map"].values()))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "weight_map")
    (src / "model.safetensors.index.json").write_text("[]")
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "not a JSON object")
    nothing_written(tmp_path)


def test_hub_cache_symlinked_shards_still_convert(src, tmp_path, run_cli):
    """The hub cache stores shards as symlinks into ../../blobs/<sha256>: judged by name, they are inside."""
    shard(src)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for f in sorted(src.glob("model-*.safetensors")):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(blobs / digest)
        f.symlink_to(os.path.relpath(blobs / digest, src))
    code, out, err = run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out")
    assert code == 0, err
    record = json.loads((tmp_path / "out" / "surgery.json").read_text())
    assert sorted(record["source"]["shards_sha256"]) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert load_file(tmp_path / "out" / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"].shape == (8, 64)


@pytest.mark.parametrize("where", ["source", "parent", "inside"])
def test_force_never_removes_the_source(src, tmp_path, run_cli, where):
    (tmp_path / "keep.txt").write_text("unrelated file in the parent")
    (src / "sub").mkdir()
    out = {"source": src, "parent": tmp_path, "inside": src / "sub"}[where]
    before = digest_tree(tmp_path)
    line = assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", out, "--force"), "source folder")
    assert digest_tree(tmp_path) == before and (src / "sub").is_dir()
    # through a symlink to the source too
    (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(src)
    assert_one_line(run_cli("convert", tmp_path.parent / f"{tmp_path.name}-link", "--to", "mqa", "--out", src, "--force"),
                    "source folder")
    assert digest_tree(tmp_path) == before, line


def test_force_still_replaces_an_ordinary_output(src, tmp_path, run_cli):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    code, _, err = run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out", "--force")
    assert code == 0, err
    assert not (tmp_path / "out" / "old.txt").exists() and (tmp_path / "out" / "model.safetensors").is_file()


def _slow_convert_script(src: Path, out: Path) -> str:
    """A convert whose tensor writes are slowed down, so a signal lands mid-write."""
    return (
        "import sys, time\n"
        "import surgery.checkpoint.tensors as t\n"
        "real = t._write_tensor\n"
        "def slow(fd, x):\n"
        "    time.sleep(0.5)\n"
        "    real(fd, x)\n"
        "t._write_tensor = slow\n"
        f"sys.argv = ['surgery', 'convert', {str(src)!r}, '--to', 'mqa', '--out', {str(out)!r}]\n"
        "import cli\n"
        "cli.main()\n"
    )


def test_sigterm_mid_convert_removes_the_temporary_folder(src, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _slow_convert_script(src, out)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "SURGERY_CACHE": str(tmp_path / "cache")})
    deadline = time.time() + 120
    while not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 143 and len(lines) == 1 and "terminated" in lines[0], err
    nothing_written(tmp_path)


def test_a_forked_worker_exits_on_sigterm_instead_of_raising():
    """A library's fork pool (lm-eval's bootstrap in `check --tasks`) inherits the CLI's SIGTERM handler; the pool
    terminates its workers with SIGTERM, and a worker that raised instead of exiting left `check` waiting forever."""
    from surgery import cli

    cli._HANDLER_PID.append(os.getpid())
    try:
        pid = os.fork()
        if pid == 0:  # the worker: the handler must end the process, never return or raise
            try:
                cli._on_sigterm(signal.SIGTERM, None)
            except BaseException:
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGTERM
        with pytest.raises(cli.Terminated):  # the process that installed it still unwinds and cleans up
            cli._on_sigterm(signal.SIGTERM, None)
    finally:
        cli._HANDLER_PID.pop()


def test_stale_temporary_siblings_of_a_killed_run_are_removed(src, tmp_path, run_cli):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # that process has exited
    stale = tmp_path / f".out.tmp-{dead_pid}-abc123"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"x" * 1000)
    live = tmp_path / f".out.tmp-{os.getppid()}-def456"  # owned by a process that still runs
    live.mkdir()
    legacy = tmp_path / ".out.tmp-q1w2e3"  # no PID: an older version's, owner unknown
    legacy.mkdir()
    code, _, err = run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out")
    assert code == 0, err
    assert not stale.exists() and live.is_dir() and legacy.is_dir()
    warnings = [l for l in err.splitlines() if l.startswith("surgery: warning:")]
    assert len(warnings) == 1 and live.name in warnings[0] and legacy.name in warnings[0], err


def test_disk_full_gives_one_line_and_removes_the_temporary_folder(src, tmp_path, run_cli, monkeypatch):
    import surgery.checkpoint.tensors

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(surgery.checkpoint.tensors.os, "write", full)
    line = assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "disk full")
    monkeypatch.undo()
    assert str(tmp_path / "out") in line
    nothing_written(tmp_path)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs (where this user may mount one), smaller than the tiny model."""
    from hostile import small_tmpfs

    with small_tmpfs(tmp_path / "small") as mount:
        yield mount


def test_real_disk_full_on_a_tiny_tmpfs(src, tiny_tmpfs, run_cli):
    line = assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tiny_tmpfs / "out"), "disk full")
    assert str(tiny_tmpfs / "out") in line
    assert list(tiny_tmpfs.iterdir()) == []


def _custom_code_source(src: Path, marker: Path) -> None:
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
    (src / "configuration_x.py").write_text(code + "from transformers import LlamaConfig\nclass XConfig(LlamaConfig):\n    pass\n")
    (src / "modeling_x.py").write_text(code + "from .helpers_x import helper\n")
    (src / "helpers_x.py").write_text("def helper():\n    return 1\n")
    edit_config(src, auto_map={"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"})


def test_custom_code_source_keeps_its_code_without_running_it(src, tmp_path, run_cli):
    marker = tmp_path / "MARKER"
    _custom_code_source(src, marker)
    code, _, err = run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out")
    assert code == 0, err
    out = tmp_path / "out"
    for name in ("configuration_x.py", "modeling_x.py", "helpers_x.py"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    record = json.loads((out / "surgery.json").read_text())
    assert {"configuration_x.py", "modeling_x.py", "helpers_x.py"} <= set(record["output_sha256"])
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoConfig"] == "configuration_x.XConfig"
    assert not marker.exists()


def test_custom_code_source_missing_its_code_is_refused(src, tmp_path, run_cli):
    marker = tmp_path / "MARKER"
    _custom_code_source(src, marker)
    (src / "helpers_x.py").unlink()
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "helpers_x.py")
    edit_config(src, auto_map={"AutoConfig": "../../evil.XConfig"})
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"))
    nothing_written(tmp_path)
    assert not marker.exists()


# --- section 3: tensors against config.json, offsets, the hash cache --------------------------------------------


def test_k_proj_with_more_rows_than_the_config_implies(src, tmp_path, run_cli):
    def grow(state):
        state["model.layers.1.self_attn.k_proj.weight"] = torch.randn(48, 64)

    edit_tensors(src, grow)
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"),
                    "model.layers.1.self_attn.k_proj.weight", "48", "32", "config.json")
    nothing_written(tmp_path)


def test_kv_heads_that_do_not_divide_the_heads(src, tmp_path, run_cli):
    edit_config(src, num_attention_heads=4, head_dim=16, num_key_value_heads=3)
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "config.json",
                    "num_key_value_heads 3", absent=("--kv-heads",))
    nothing_written(tmp_path)


def test_tensors_holding_fewer_kv_heads_than_the_config_says(src, tmp_path, run_cli):
    # 4 heads of 16: q_proj's 64 rows fit, but k/v_proj's 32 rows hold 2 K/V heads where config.json says 4
    edit_config(src, num_attention_heads=4, head_dim=16, num_key_value_heads=4)
    assert_one_line(run_cli("convert", src, "--to", "gqa", "--kv-heads", "2", "--out", tmp_path / "out"),
                    "k_proj", "config.json", "4 K/V heads")
    nothing_written(tmp_path)


@pytest.mark.parametrize("heads", [-4, 0, 10**12, "8", 8.0, True, None])
def test_bad_head_counts(src, tmp_path, run_cli, heads):
    edit_config(src, num_attention_heads=heads)
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "num_attention_heads")
    assert_one_line(run_cli("inspect", src), "num_attention_heads")
    nothing_written(tmp_path)


@pytest.mark.parametrize("kv", [0, -2, 10**12])
def test_bad_kv_head_counts_blame_config_json(src, tmp_path, run_cli, kv):
    edit_config(src, num_key_value_heads=kv)
    for args in (("--to", "mqa"), ("--to", "gqa", "--kv-heads", "2")):
        assert_one_line(run_cli("convert", src, *args, "--out", tmp_path / "out"), "config.json", "num_key_value_heads",
                        absent=("--kv-heads",))
    assert_one_line(run_cli("inspect", src), "num_key_value_heads")
    nothing_written(tmp_path)


def test_overlapping_data_offsets(src, tmp_path, run_cli):
    path = src / "model.safetensors"
    header, data = read_header(path)
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    size_b = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    start = header[a]["data_offsets"][0]
    header[b]["data_offsets"] = [start, start + size_b]  # k_proj's bytes are the start of q_proj's
    write_header(path, header, data)
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "overlap")
    nothing_written(tmp_path)


@pytest.mark.parametrize("where", ["gap", "trailing"])
def test_bytes_that_belong_to_no_tensor(src, tmp_path, run_cli, where):
    """The safetensors format tiles the data exactly (its reference reader refuses gaps and trailing bytes)."""
    path = src / "model.safetensors"
    header, data = read_header(path)
    if where == "gap":
        for entry in header.values():
            if isinstance(entry, dict) and "data_offsets" in entry:
                entry["data_offsets"] = [o + 8 for o in entry["data_offsets"]]
        data = b"\0" * 8 + data
    else:
        data = data + b"\0" * 8
    write_header(path, header, data)
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "belong to no tensor")
    nothing_written(tmp_path)


@pytest.mark.parametrize("offsets", [[10**9, 10**9 + 8192], [-8192, 0], [8192, 0], ["0", "8192"]])
def test_data_offsets_outside_the_file(src, tmp_path, run_cli, offsets):
    path = src / "model.safetensors"
    header, data = read_header(path)
    name = "model.layers.0.self_attn.k_proj.weight"
    header[name]["data_offsets"] = offsets
    write_header(path, header, data)
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "safetensors")
    assert_one_line(run_cli("inspect", src), "safetensors")
    nothing_written(tmp_path)


@pytest.mark.parametrize("cache", ["[]", "garbage{", '{"x": 5}', "[1, 2, {}]"])
def test_corrupt_hash_cache_is_ignored(src, tmp_path, run_cli, private_hash_cache, cache):
    private_hash_cache.parent.mkdir(parents=True, exist_ok=True)
    private_hash_cache.write_text(cache)
    code, _, err = run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out")
    assert code == 0 and "Traceback" not in err and "Exception" not in err, err
    recorded = json.loads((tmp_path / "out" / "surgery.json").read_text())["source"]["shards_sha256"]
    assert recorded == {"model.safetensors": hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()}
    assert isinstance(json.loads(private_hash_cache.read_text()), dict)  # rewritten as a cache


# --- section 4: one line instead of tracebacks and hangs ---------------------------------------------------------


@pytest.mark.parametrize("config", ["[]", "3", '"text"', "null", "{", ""])
def test_config_that_is_not_an_object(src, tmp_path, run_cli, config):
    (src / "config.json").write_text(config)
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "config.json")
    assert_one_line(run_cli("inspect", src), "config.json")
    nothing_written(tmp_path)


@pytest.mark.parametrize("header", [[1, 2], "text", {"t": [1]}, {"t": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}},
                                    {"t": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}},
                                    {"__metadata__": [1], "t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}])
def test_safetensors_header_that_is_not_well_formed(src, tmp_path, run_cli, header):
    write_header(src / "model.safetensors", header, b"\0" * 16)
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "model.safetensors")
    assert_one_line(run_cli("inspect", src), "model.safetensors")
    nothing_written(tmp_path)


def test_fifo_named_model_safetensors_does_not_hang(src, tmp_path):
    (src / "model.safetensors").unlink()
    os.mkfifo(src / "model.safetensors")
    for args in (("convert", src, "--to", "mqa", "--out", tmp_path / "out"), ("inspect", src)):
        r = subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "SURGERY_CACHE": str(tmp_path / "cache")})
        assert_one_line((r.returncode, r.stdout, r.stderr), "FIFO")
    nothing_written(tmp_path)


def test_fifo_config_json_does_not_hang(src, tmp_path, run_cli):
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    assert_one_line(run_cli("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "FIFO")
    assert_one_line(run_cli("inspect", src), "FIFO")


@pytest.mark.parametrize("kv", ["0", "-1"])
def test_aligned_merge_with_zero_kv_heads(src, tmp_path, run_cli, kv):
    assert_one_line(run_cli("convert", src, "--to", "gqa", "--merge", "aligned", "--kv-heads", kv, "--out",
                            tmp_path / "out"), "--kv-heads")
    nothing_written(tmp_path)


def test_inspect_missing_head_fields(src, run_cli):
    edit_config(src, num_attention_heads=None)
    assert_one_line(run_cli("inspect", src), "num_attention_heads")
    edit_config(src, num_attention_heads=8, hidden_size=None)
    assert_one_line(run_cli("inspect", src), "hidden_size")


@pytest.mark.parametrize("record", ["{", "[]", '{"kv_heads": 3}', '{"kind": []}'])
def test_inspect_corrupt_surgery_json(src, run_cli, record):
    (src / "surgery.json").write_text(record)
    assert_one_line(run_cli("inspect", src), "surgery.json")


@pytest.mark.parametrize("context", ["-4096", "0"])
def test_inspect_negative_context(src, run_cli, context):
    assert_one_line(run_cli("inspect", src, "--context", context), "--context")


def test_inspect_still_works(src, run_cli):
    code, out, err = run_cli("inspect", src, "--json")
    assert code == 0, err
    stats = json.loads(out)[0]
    assert stats["heads"] == 8 and stats["kv_heads"] == 4 and stats["kv_cache_bytes_per_token"] == 2 * 2 * 4 * 8 * 4
