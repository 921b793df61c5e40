"""Code from a checkpoint never runs unasked.

A hostile tiny checkpoint ships `configuration_x.py` / `modeling_x.py` (named by its config's `auto_map`) that
create a marker file when imported, and a hostile pickle carries a payload that creates one when unpickled. Each
test first shows the payload works when it is run (so the tests can fail), then that no command runs it unless
the user passed the flag for that very model. The toolkit's own modeling code in its own outputs loads without a
flag, recognised by sha256; one changed byte and it is refused like a stranger's.
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

from hostile import cli_error, hostile_checkpoint, listing, ran
from inprocess import assert_one_line_error, surgery

from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

from surgery import trust
from surgery.errors import SurgeryError
from surgery.checkpoint.source import resolve_source

REPO = Path(__file__).resolve().parents[2]
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: connection refused
UPTRAIN_FAST = ("--tokens", "512", "--seq-len", "32", "--batch-tokens", "128", "--micro-batch", "4",
                "--eval-tokens", "0", "--save-every", "0")

@pytest.fixture
def hostile(tmp_path):
    markers = tmp_path / "markers"
    return hostile_checkpoint(tmp_path / "hostile", markers), markers


# ---- the payload is real -----------------------------------------------------------------------------------
def test_the_hostile_code_runs_when_the_user_trusts_it(hostile, tmp_path):
    """The control: with --trust-remote-code for the model, uptrain imports (and trains) the folder's code."""
    folder, markers = hostile
    result = surgery("uptrain", folder, "--out", tmp_path / "out", "--loss", "lm", *UPTRAIN_FAST,
                     "--trust-remote-code")
    assert result.returncode == 0, result.stderr
    assert ran(markers) == ["configuration_x", "modeling_x"]


# ---- uptrain: the model, --teacher, and the teacher named in surgery.json ----------------------------------
def test_uptrain_refuses_a_model_with_code_unless_trusted(hostile, tmp_path):
    folder, markers = hostile
    before = listing(folder)
    result = surgery("uptrain", folder, "--out", tmp_path / "out", "--loss", "lm", *UPTRAIN_FAST)
    assert_one_line_error(result, "configuration_x.py", "modeling_x.py", "--trust-remote-code")
    assert ran(markers) == [] and not (tmp_path / "out").exists() and listing(folder) == before


def test_uptrain_trusts_the_teacher_only_with_its_own_flag(hostile, tmp_path):
    folder, markers = hostile
    student = tmp_path / "student"
    tm.make_tiny("llama", student, seed=1)
    char_tokenizer(student)
    args = ("uptrain", student, "--out", tmp_path / "out", "--teacher", folder, "--loss", "kd", *UPTRAIN_FAST)
    assert_one_line_error(surgery(*args), "teacher", "modeling_x.py", "--trust-teacher-code")
    message = cli_error(*args, "--trust-remote-code")  # trusting the model does not trust the teacher
    assert "teacher" in message and "--trust-teacher-code" in message
    assert ran(markers) == [] and not (tmp_path / "out").exists()


def test_uptrain_refuses_the_default_teacher_named_in_surgery_json(hostile, tmp_path):
    folder, markers = hostile
    student = tmp_path / "student"
    tm.make_tiny("llama", student, seed=1)
    char_tokenizer(student)
    (student / "surgery.json").write_text(json.dumps({"toolkit": "surgery", "kind": "mqa", "source": {
        "spec": str(folder), "folder": str(folder)}}))
    result = surgery("uptrain", student, "--out", tmp_path / "out", *UPTRAIN_FAST)  # loss auto: kd from the source
    assert_one_line_error(result, "teacher", "--trust-teacher-code")
    assert ran(markers) == []


# ---- push ------------------------------------------------------------------------------------------------
def test_push_validates_without_importing_and_fails_in_one_line_on_an_unreachable_hub(hostile, tmp_path):
    from surgery.publish import validate_folder

    folder, markers = hostile
    before = listing(folder)
    validation = validate_folder(folder)  # the code files are present and parse; none is imported
    assert validation.code_files == ["configuration_x.py", "modeling_x.py"]
    env = {"HF_ENDPOINT": UNREACHABLE, "HF_TOKEN": "hf_test", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
           "HF_HOME": str(tmp_path / "hf-home")}
    result = surgery("push", folder, "alice/x", env=env)
    assert_one_line_error(result, "cannot push to alice/x", UNREACHABLE)
    assert ran(markers) == []
    assert listing(folder) == before  # no model card written into the folder

    (folder / "model.safetensors").unlink()  # local validation comes before any network call
    assert_one_line_error(surgery("push", folder, "alice/x", env=env), "has no weights")


# ---- recipes -----------------------------------------------------------------------------------------------
def recipe(tmp_path: Path, source: dict, steps: list) -> Path:
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"source": source, "output": str(tmp_path / "run"), "steps": steps}))
    return path


def test_recipes_never_add_trust_on_their_own(hostile, tmp_path):
    folder, markers = hostile
    before = listing(folder)
    path = recipe(tmp_path, {"path": str(folder)}, [{"convert": {"to": "mqa"}},
                                                   {"check": {"tokens": 256, "seq_len": 32, "batch_size": 2}}])
    dry = surgery("run", path, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "--trust" not in dry.stdout and ran(markers) == []
    result = surgery("run", path)
    assert "--trust" not in result.stdout
    assert result.returncode in (0, 2), result.stderr  # check may refuse the source's code: then in one line
    if result.returncode == 2:
        assert_one_line_error(result, "--trust")
    assert ran(markers) == [] and listing(folder) == before


def test_a_recipe_field_says_visibly_what_is_trusted(tmp_path):
    from surgery.recipes import load_recipe
    from surgery.recipes.runner import command_line, plan_steps

    steps = [{"convert": {"to": "mqa"}}, {"check": {"tokens": 256}}, {"check": {"tokens": 256, "trust_remote_code": True}},
             {"uptrain": {"tokens": 512, "trust_teacher_code": True}}]
    r = load_recipe(recipe(tmp_path, {"path": str(tmp_path / "src")}, steps))
    lines = [command_line(r, ps) for ps in plan_steps(r, tmp_path / "run")]
    assert not any(a.startswith("--trust") for a in lines[0] + lines[1])
    assert "--trust-remote-code" in lines[2]
    assert "--trust-teacher-code" in lines[3] and "--trust-remote-code" not in lines[3]


def test_a_package_source_is_found_without_importing_it(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    pkg = tmp_path / "site" / "evilpkg"
    (pkg / "sub" / "model").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text(f"import pathlib\npathlib.Path({str(markers)!r}).joinpath({init.parent.name!r}).write_text('x')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    control = subprocess.run([sys.executable, "-c", "import importlib.util; importlib.util.find_spec('evilpkg.sub')"],
                             env={**os.environ, **env}, capture_output=True, text=True)
    assert control.returncode == 0 and ran(markers) == ["evilpkg"]  # find_spec on a dotted name imports the parent
    (markers / "evilpkg").unlink()

    path = recipe(tmp_path, {"package": "evilpkg.sub", "path": "model"}, [{"convert": {"to": "mqa"}}])
    dry = surgery("run", path, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert str(pkg / "sub" / "model") in dry.stdout.replace("\n", "")
    assert ran(markers) == []
    missing = recipe(tmp_path, {"package": "evilpkg.nothere", "path": "model"}, [{"convert": {"to": "mqa"}}])
    assert_one_line_error(surgery("run", missing, "--dry-run", env=env), "evilpkg.nothere")
    assert ran(markers) == []


# ---- pickles -----------------------------------------------------------------------------------------------
class Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('unpickled')",)


def test_inspect_reads_pickles_only_with_allow_pickle_and_never_runs_them(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    benign, evil = tmp_path / "benign", tmp_path / "evil"
    model = tm.make_tiny("llama", benign)
    (benign / "model.safetensors").unlink()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(state, benign / "pytorch_model.bin")
    shutil.copytree(benign, evil)
    torch.save({**state, "extra": Payload(markers / "pickle")}, evil / "pytorch_model.bin")
    torch.load(evil / "pytorch_model.bin", weights_only=False)  # the control: unpickling runs the payload
    assert ran(markers) == ["pickle"]
    (markers / "pickle").unlink()

    from surgery.inspection import inspect_checkpoint

    assert_one_line_error(surgery("inspect", evil), "pickle", "--allow-pickle")
    assert "--allow-pickle" in cli_error("inspect", benign)
    assert inspect_checkpoint(benign, allow_pickle=True)["parameters"] == sum(t.numel() for t in state.values())
    assert "cannot read pickle checkpoint" in cli_error("inspect", evil, "--allow-pickle")  # weights_only=True
    assert ran(markers) == []


# ---- the toolkit's own code --------------------------------------------------------------------------------
def convert_tiny(kind: str, src: Path, out: Path) -> dict:
    if kind == "talking-heads":
        from surgery.talking_heads import convert_to_talking_heads
        from surgery.talking_heads.options import TalkingHeadsOptions

        return convert_to_talking_heads(resolve_source(str(src)), out, TalkingHeadsOptions(), progress=False)
    from surgery.switchhead import convert_to_switchhead
    from surgery.switchhead.options import SwitchHeadOptions

    options = SwitchHeadOptions(heads=4, experts=2, topk=1, calib=["pydoc"], calib_tokens=512)
    return convert_to_switchhead(resolve_source(str(src)), out, options, progress=False)


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own") / "src"
    tm.make_tiny("llama", folder)
    char_tokenizer(folder)
    return folder


@pytest.mark.parametrize("kind", ["talking-heads", "switchhead"])
def test_own_outputs_load_without_flags_and_one_changed_byte_is_refused(kind, tiny_source, tmp_path):
    from surgery.training.model_io import load_causal_lm

    out = tmp_path / "out"
    record = convert_tiny(kind, tiny_source, out)
    code = sorted(record["code_sha256"])
    assert code == trust.code_references(out) and all(trust.own_code_hashes()[n] == record["code_sha256"][n] for n in code)
    assert trust.is_own_code(out) and trust.resolve_trust(out, False) is True
    model = load_causal_lm(resolve_source(str(out)), "model")  # no flag needed
    assert type(model).__module__.split(".")[-1] in {Path(n).stem for n in code}

    for name in code:  # one byte changed in either file, and the folder is a stranger's
        changed = tmp_path / f"changed-{name}"
        shutil.copytree(out, changed)
        data = bytearray((changed / name).read_bytes())
        data[data.index(b"\n") - 1] ^= 0x20  # flip the case of the first line's last character
        (changed / name).write_bytes(bytes(data))
        assert not trust.is_own_code(changed)
        with pytest.raises(SurgeryError, match=f"ships its own modeling code .*{name}.*pass --trust-remote-code"):
            load_causal_lm(resolve_source(str(changed)), "model")
        assert trust.resolve_trust(changed, True) is True  # the user may still choose to run it

    unrecorded = tmp_path / "unrecorded"  # the shipped files, but surgery.json does not vouch for them
    shutil.copytree(out, unrecorded)
    rec = json.loads((unrecorded / "surgery.json").read_text())
    rec["code_sha256"][code[0]] = "0" * 64
    (unrecorded / "surgery.json").write_text(json.dumps(rec))
    assert not trust.is_own_code(unrecorded)
    for broken in ("{not json", json.dumps({**record, "code_sha256": list(code)}), json.dumps([record])):
        (unrecorded / "surgery.json").write_text(broken)  # a corrupt or mistyped record vouches for nothing
        assert not trust.is_own_code(unrecorded)
        with pytest.raises(SurgeryError, match="ships its own modeling code"):
            load_causal_lm(resolve_source(str(unrecorded)), "model")
    (unrecorded / "surgery.json").unlink()
    assert not trust.is_own_code(unrecorded)


def test_own_output_uptrains_from_the_cli_without_flags_and_stays_trusted(tiny_source, tmp_path):
    out, trained = tmp_path / "th", tmp_path / "trained"
    convert_tiny("talking-heads", tiny_source, out)
    result = surgery("uptrain", out, "--out", trained, *UPTRAIN_FAST)  # kd from the source, both without flags
    assert result.returncode == 0, result.stderr
    assert trust.is_own_code(trained)  # the uptrained output carries the same files and their record

    (out / "modeling_talking_heads.py").write_text((out / "modeling_talking_heads.py").read_text() + "\n# edited\n")
    result = surgery("uptrain", out, "--out", tmp_path / "again", *UPTRAIN_FAST)
    assert_one_line_error(result, "modeling_talking_heads.py", "--trust-remote-code")


# ---- convert: tensor surgery and calibration never run the source's code -----------------------------------
@pytest.mark.parametrize("args", [("--to", "mqa"), ("--to", "gqa", "--kv-heads", "2", "--merge", "aligned", "--calib-tokens", "512"),
                                  ("--to", "talking-heads"),
                                  ("--to", "switchhead", "--heads", "4", "--experts", "2", "--topk", "1", "--calib-tokens", "512")],
                         ids=["mqa", "aligned", "talking-heads", "switchhead"])
def test_convert_never_runs_the_source_code(args, hostile, tmp_path):
    import cli

    folder, markers = hostile
    try:
        cli.cli.main(["convert", str(folder), "--out", str(tmp_path / "out"), *args], prog_name="surgery",
                     standalone_mode=False)
    except SurgeryError:
        pass  # refusing a source with code is fine; running its code is not
    assert ran(markers) == []
