"""The Python API (`import surgery`): results, options shared with the command line, errors, a loaded model as the
source, datasets and lists of documents as data — on the tiny pydoc Llama (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import surgery
from surgery.data import pydoc_texts

REPO = Path(__file__).resolve().parents[2]
DOCS = pydoc_texts()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A private cache: loaded models and data objects are written here, not into ~/.cache/surgery."""
    import surgery.checkpoint.source as source

    monkeypatch.setattr(source, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out |= load_file(f)
    return out


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_import_surgery_imports_no_torch_until_a_function_runs():
    code = ("import sys, surgery\n"
            "assert not {'torch', 'transformers', 'datasets'} & set(sys.modules), 'import surgery'\n"
            "f = surgery.convert\n"
            "assert not {'torch', 'transformers', 'datasets'} & set(sys.modules), 'surgery.convert'\n"
            "assert callable(surgery.check) and callable(surgery.inspect)\n"
            "import surgery.checking.compare, surgery.inspection, surgery.training.loop\n"  # the implementation
            "assert surgery.check is sys.modules['surgery.api'].check, surgery.check\n"
            "assert surgery.inspect is sys.modules['surgery.api'].inspect, surgery.inspect\n"
            "assert surgery.uptrain is sys.modules['surgery.api'].uptrain, surgery.uptrain\n"
            "assert surgery.SurgeryError is sys.modules['surgery.errors'].SurgeryError\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["check", "inspect", "uptrain", "convert", "push", "teacher", "snapshot"])
def test_no_module_shares_an_api_functions_name(name):
    """`import surgery.X` cannot rebind the function `surgery.X` to a module: no module or package of that name
    exists, so the import fails plainly and `surgery.X` stays the one function everywhere."""
    code = (f"import sys, surgery, importlib.util\n"
            f"assert importlib.util.find_spec('surgery.{name}') is None\n"
            f"try:\n    import surgery.{name}\nexcept ModuleNotFoundError:\n    pass\n"
            f"else:\n    raise SystemExit('surgery.{name} is a module')\n"
            f"import surgery.cli, surgery.api\n"
            f"assert callable(surgery.{name}) and surgery.{name} is sys.modules['surgery.api'].{name}\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_the_package_has_no_module_class_tricks():
    for path in (REPO / "surgery").rglob("*.py"):
        text = path.read_text()
        assert "__class__ =" not in text and "sys.modules[__name__]" not in text, path


def test_an_unknown_keyword_is_named_with_the_closest_option_before_any_work(tiny, tmp_path, cache):
    with pytest.raises(surgery.SurgeryError, match=r"^unknown option 'kv_head'; did you mean 'kv_heads'\?$"):
        surgery.convert(tiny, tmp_path / "out", to="gqa", kv_head=1, calib=DOCS[:3])
    assert not (cache / "data").exists()  # the calibration list was not written
    with pytest.raises(surgery.SurgeryError, match=r"^unknown option 'tokns'; did you mean 'tokens'\?$"):
        surgery.check(tiny, tiny, tokns=64)
    assert not (tmp_path / "out").exists()


def test_a_broken_rule_is_the_line_the_command_line_prints(tiny, tmp_path, cli):
    code, _, err = cli("convert", str(tiny), "--out", str(tmp_path / "a"), "--to", "gqa")
    assert code == 2
    with pytest.raises(surgery.SurgeryError) as e:
        surgery.convert(tiny, tmp_path / "b", to="gqa")
    assert err.strip() == f"surgery: error: {e.value}"
    code, _, err = cli("check", str(tiny), str(tiny), "--tokens", "0")
    with pytest.raises(surgery.SurgeryError) as e:
        surgery.check(tiny, tiny, tokens=0)
    assert code == 2 and err.strip() == f"surgery: error: {e.value}"


def test_convert_returns_folder_record_and_loads_the_model(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    result = surgery.convert(tiny, tmp_path / "mqa", to="mqa")
    assert isinstance(result, surgery.ConversionResult)
    assert result.folder == tmp_path / "mqa" and result.kind == "mqa"
    assert result.record == json.loads((tmp_path / "mqa" / "surgery.json").read_text())
    assert result.record["kind"] == "mqa" and result.message.startswith(f"wrote {tmp_path / 'mqa'}: mqa")
    model = result.load()
    assert model.config.num_key_value_heads == 1
    direct = AutoModelForCausalLM.from_pretrained(tmp_path / "mqa")
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    assert torch.equal(model(ids).logits, direct(ids).logits)
    assert result.load_tokenizer()("def f():")["input_ids"]


def test_a_loaded_model_converts_as_its_folder_does(tiny, tmp_path, cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    from_folder = surgery.convert(tiny, tmp_path / "a", to="mqa", merge="mean")
    from_model = surgery.convert(model, tmp_path / "b", to="mqa", merge="mean", tokenizer=tok)
    assert same_weights(from_folder.folder, from_model.folder)
    saved = Path(from_model.record["local"]["source_folder"])
    assert saved.parent == cache / "loaded" and (saved / "tokenizer.json").is_file()
    again = surgery.convert(model, tmp_path / "c", to="mqa", merge="mean", tokenizer=tok)
    assert again.record["local"]["source_folder"] == str(saved)  # the same model is saved once
    assert len(list((cache / "loaded").iterdir())) == 1
    # without a tokenizer: the one of the folder the model was loaded from
    bare = surgery.convert(model, tmp_path / "d", to="mqa", merge="mean")
    assert (Path(bare.record["local"]["source_folder"]) / "tokenizer.json").is_file()


def test_a_loaded_model_with_no_tokenizer_is_told_to_pass_tokenizer(tiny, tmp_path, cache):
    """A loaded model not loaded from a local folder with a tokenizer, and given none: uptrain, teacher and check
    refuse it before saving it, a calibrated convert when it needs the tokenizer, each in one line naming
    `tokenizer=` (it named the cache folder the model was saved into); with `tokenizer=` it runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from surgery.errors import SurgeryError

    model = AutoModelForCausalLM.from_pretrained(tiny)
    model.name_or_path = ""  # as a model built or changed in memory
    text = dict(tokens=512, data="pydoc", seq_len=64, batch_tokens=512, eval_tokens=0)
    calls = {"uptrain": lambda: surgery.uptrain(model, tmp_path / "u", **text),
             "teacher": lambda: surgery.teacher(model, tmp_path / "t", **text),
             "check": lambda: surgery.check(model, tiny, tokens=128, seq_len=64)}
    for name, call in calls.items():
        with pytest.raises(SurgeryError) as e:
            call()
        assert str(e.value).startswith(f"{name}: the loaded LlamaForCausalLM comes with no tokenizer "), str(e.value)
        assert "\n" not in str(e.value) and "pass tokenizer=" in str(e.value) and str(cache) not in str(e.value)
    assert not (cache / "loaded").exists() and not (tmp_path / "u").exists() and not (tmp_path / "t").exists()
    with pytest.raises(SurgeryError) as e:
        surgery.convert(model, tmp_path / "gqa", to="gqa", kv_heads=1, merge="aligned", calib_tokens=256)
    assert "\n" not in str(e.value) and "pass tokenizer=" in str(e.value) and str(cache) not in str(e.value)
    assert not (tmp_path / "gqa").exists()
    report = surgery.check(model, tiny, tokens=128, seq_len=64, tokenizer=AutoTokenizer.from_pretrained(tiny))
    assert report.tokens == 128 and report.exact  # the same weights as the folder


def test_calibration_from_a_dataset_a_list_or_a_file_is_the_same(tiny, tmp_path):
    import datasets

    docs = DOCS[-60:]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    common = dict(to="mqa", merge="aligned", calib_tokens=1024, calib_window=64)
    from_file = surgery.convert(tiny, tmp_path / "file", calib=str(tmp_path / "docs.jsonl"), **common)
    from_list = surgery.convert(tiny, tmp_path / "list", calib=docs, **common)
    dataset = datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))})
    from_ds = surgery.convert(tiny, tmp_path / "ds", calib=dataset, **common)
    from_iter = surgery.convert(tiny, tmp_path / "iter", calib=dataset.to_iterable_dataset(), **common)
    for r in (from_list, from_ds, from_iter):
        assert same_weights(from_file.folder, r.folder), r.folder
        assert r.record["calibration"]["tokens"] == 1024
        assert r.record["calibration"]["documents_sha256"] == from_file.record["calibration"]["documents_sha256"]
    assert from_list.record["calibration"]["data"] == from_ds.record["calibration"]["data"]  # same rows, same file
    # a mixture: a tuple of sources, each its share of the windows
    mixed = surgery.convert(tiny, tmp_path / "mix", calib=("pydoc", docs[:30]), **common)
    assert [p["windows"] for p in mixed.record["calibration"]["mixture"]] == [8, 8]
    with pytest.raises(surgery.SurgeryError, match="no column 'text'"):
        surgery.convert(tiny, tmp_path / "bad", calib=datasets.Dataset.from_dict({"body": docs}), **common)


def test_a_streamed_dataset_is_read_no_further_than_the_tokens_need(tiny, tmp_path):
    import datasets

    from surgery.api.sources import CHARS_PER_TOKEN

    read = []

    def rows():
        for i in range(10**9):  # endless
            read.append(i)
            yield {"text": DOCS[i % len(DOCS)]}

    stream = datasets.IterableDataset.from_generator(rows)
    result = surgery.convert(tiny, tmp_path / "s", to="mqa", merge="aligned", calib=stream, calib_tokens=512,
                             calib_window=64)
    assert result.record["calibration"]["tokens"] == 512
    written = Path(result.record["calibration"]["data"]).stat().st_size
    assert written < 512 * CHARS_PER_TOKEN + max(len(json.dumps({"text": d})) for d in DOCS) + 1
    assert len(read) < 1000


def test_check_returns_the_numbers_json_writes(tiny, tmp_path):
    mqa = surgery.convert(tiny, tmp_path / "mqa", to="mqa")
    report = surgery.check(tiny, mqa, tokens=256, seq_len=64, json_out=tmp_path / "r.json")
    written = json.loads((tmp_path / "r.json").read_text())
    assert isinstance(report, surgery.CheckReport)
    assert report.to_dict() == written
    assert report.kl == written["kl"] > 0 and report["top1_agreement"] < 1 and report.tokens == 256
    same = surgery.check(tiny, tiny, tokens=128, seq_len=64, data=DOCS[:20])
    assert same.max_abs_diff == 0 and same.exact and same.passed_exact and same.tokens == 128
    with pytest.raises(AttributeError, match="no field 'nope'"):
        same.nope


def test_inspect_reports_each_checkpoint(tiny, tmp_path):
    mqa = surgery.convert(tiny, tmp_path / "mqa", to="mqa")
    src, out = surgery.inspect(tiny, mqa, context=128)
    assert (src.kv_heads, out.kv_heads) == (2, 1) and src.heads == out.heads == 4
    assert out.kv_cache_bytes_per_token * 2 == src.kv_cache_bytes_per_token
    assert src.context == 128


def test_uptrain_returns_its_metrics_with_list_and_dataset_data(tiny, tmp_path):
    import datasets

    mqa = surgery.convert(tiny, tmp_path / "mqa", to="mqa")
    held_out = datasets.Dataset.from_dict({"text": DOCS[:40]})
    result = surgery.uptrain(mqa, tmp_path / "up", data=DOCS[40:], eval_data=held_out, tokens=1024, seq_len=64,
                             batch_tokens=512, micro_batch=4, eval_tokens=256, eval_every=0, save_every=0, lr=3e-3,
                             progress=False)
    assert isinstance(result, surgery.UptrainResult)
    rows = [json.loads(line) for line in (tmp_path / "up" / "uptrain_metrics.jsonl").read_text().splitlines()]
    assert result.metrics == rows and rows[-1]["tokens"] == 1024
    assert result.uptraining["tokens"] == 1024 and result.uptraining["eval_data"].endswith(".jsonl")
    assert result.load().config.num_key_value_heads == 1
    with pytest.raises(surgery.SurgeryError, match="--batch-tokens 500 must be a multiple of --seq-len 64"):
        surgery.uptrain(mqa, tmp_path / "no", tokens=1024, seq_len=64, batch_tokens=500)


def test_the_toolkit_s_own_modeling_code_loads_without_trust_and_other_code_does_not(tiny, tmp_path):
    result = surgery.convert(tiny, tmp_path / "th", to="talking-heads")
    assert result.load() is not None  # its code is the toolkit's own
    code = next(p for p in result.folder.glob("modeling_*.py"))
    code.write_text(code.read_text() + "\n# changed\n")
    with pytest.raises(surgery.SurgeryError, match="pass trust_remote_code=True to run it"):
        result.load()


def test_run_recipe_takes_a_mapping_and_skips_finished_steps(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = {"source": {"path": str(tiny)}, "output": "out",
              "steps": [{"convert": {"to": "mqa"}}, {"check": {"tokens": 128, "seq_len": 64}}]}
    first = surgery.run_recipe(recipe)
    assert first.output == Path("out") and first.steps == [("convert", "ran"), ("check", "ran")]
    assert json.loads((tmp_path / "out" / "02-check.json").read_text())["tokens"] == 128
    assert surgery.run_recipe(recipe).steps == [("convert", "skipped"), ("check", "skipped")]
    again = surgery.run_recipe(recipe, overrides=["check.tokens=192"])
    assert again.steps == [("convert", "skipped"), ("check", "ran")]
    assert recipe["steps"][1]["check"]["tokens"] == 128  # the caller's mapping is left alone
    with pytest.raises(surgery.SurgeryError, match=r"^recipe: steps\[0\]\.convert: .*kv_heads"):
        surgery.run_recipe({"source": {"path": str(tiny)}, "output": "x", "steps": [{"convert": {"to": "gqa"}}]})


def test_push_uploads_with_a_check_report_object_in_the_card(tiny, tmp_path):
    """In a fresh process (huggingface_hub reads HF_ENDPOINT when it loads) against the loopback hub."""
    from hub_server import TOKEN, USER, LocalHub, download, run_script

    script = tmp_path / "push.py"
    script.write_text(
        "import json, sys, surgery\n"
        "tiny, out = sys.argv[1], sys.argv[2]\n"
        "mqa = surgery.convert(tiny, out, to='mqa')\n"
        "report = surgery.check(tiny, mqa, tokens=128, seq_len=64)\n"
        "pushed = surgery.push(mqa, 'alice/tiny-mqa', check_reports=[report], private=True)\n"
        "print(json.dumps({'pushed': vars(pushed), 'report': report.to_dict()}))\n")
    with LocalHub(tmp_path / "hub-data", {TOKEN: USER}) as hub:
        out = run_script(hub, tmp_path, script, tiny, tmp_path / "mqa")
        assert out["pushed"]["repo_id"] == "alice/tiny-mqa" and out["pushed"]["card_written"] is True
        assert out["pushed"]["commit_url"].startswith(hub.endpoint)
        card = (download(hub, "alice/tiny-mqa", tmp_path / "dl") / "README.md").read_text()
    assert f"{100 * out['report']['top1_agreement']:.2f}%" in card
    with pytest.raises(surgery.SurgeryError, match="must be of the form owner/name"):
        surgery.push(tiny, "no-owner")


@pytest.mark.parametrize("command, own", [
    ("convert", {"out", "dry_run", "json_out", "source"}),
    ("check", {"json_out", "source", "converted"}),
    ("uptrain", {"out", "dry_run", "model"}),
    ("push", {"folder", "check_reports", "json_out"}),
    ("snapshot", {"run_dir", "out"}),
])
def test_the_api_takes_the_options_the_command_line_lists(command, own):
    """One source of truth: every option of `surgery COMMAND` is a keyword of surgery.COMMAND, under its field name,
    and nothing else is."""
    from surgery.cli import cli
    from surgery.commands.check import CheckOptions
    from surgery.commands.convert import options_model
    from surgery.commands.push import PushOptions
    from surgery.commands.snapshot import SnapshotOptions
    from surgery.commands.uptrain import UptrainArgs

    model = {"convert": options_model(), "check": CheckOptions, "uptrain": UptrainArgs, "push": PushOptions,
             "snapshot": SnapshotOptions}[command]
    params = {p.name for p in cli.commands[command].params if p.expose_value} - own
    assert params == set(model.model_fields)
    with pytest.raises(surgery.SurgeryError, match="^unknown option 'not_an_option'"):
        getattr(surgery, command)("x", "y", not_an_option=1, **({"to": "mqa"} if command == "convert" else {}))


def test_teacher_stores_a_runs_windows_and_uptrain_trains_from_it(tiny, tmp_path, monkeypatch):
    """surgery.teacher writes the store `uptrain(teacher_logprobs=...)` reads, for data given as a list of documents;
    the command line goes through it; training options are refused in the CLI's words."""
    from pydoc_data.topics import topics

    import cli

    docs = list(topics.values())
    run = dict(tokens=1024, seq_len=64, batch_tokens=512, eval_tokens=512)
    store = surgery.teacher(str(tiny), tmp_path / "store", top_k=8, data=docs, device="cpu", progress=False, **run)
    assert isinstance(store, surgery.TeacherStore) and store.bytes_per_token == 6 * 8 + 2
    assert store.windows == 1024 // 64 and os.fspath(store) == str(tmp_path / "store")
    result = surgery.uptrain(str(tiny), tmp_path / "up", data=docs, loss="kd", teacher_logprobs=store, micro_batch=4,
                             eval_every=0, save_every=0, progress=False, **run)
    assert result.uptraining["teacher"] is None and result.uptraining["teacher_logprobs"]["top_k"] == 8
    with pytest.raises(surgery.SurgeryError, match="teacher takes the run's data options only, not 'lr'"):
        surgery.teacher(str(tiny), tmp_path / "x", tokens=1024, lr=1e-3)
    seen = {}
    monkeypatch.setattr("surgery.api.teacher", lambda *a, **k: seen.update(args=a, kw=k))
    monkeypatch.setattr(sys, "argv", ["surgery", "teacher", str(tiny), "--out", str(tmp_path / "cli"), "--tokens",
                                      "1024", "--top-k", "4", "--chat-template", "off"])
    cli.main()
    assert seen["args"] == (str(tiny), tmp_path / "cli") and seen["kw"]["top_k"] == 4
    assert seen["kw"]["tokens"] == 1024 and seen["kw"]["chat_template"] == "off"
