"""Issue 53 (hardening 6), on the tiny pydoc Llama: --force never deletes a file a command reads; nothing in a run
folder is followed outside it; the public record names no place on this machine; a teacher store is a distribution
(checked before the first step, and by `surgery teacher` before it writes); --resume repeats the store and the
precision; a run refused at its first step leaves nothing that blocks the corrected command; options that would be
ignored are refused; the API's sizes are typed; a pickle in a checkpoint is one line, never unpickled."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from inprocess import cli_args
from surgery.checkpoint.record import public_record, read_record
from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST
from surgery.training import UptrainOptions, uptrain
from surgery.training.teacher_pass import teacher_pass

RUN = FAST | dict(tokens=512, eval_tokens=0, loss="kd")  # one step of 8 windows of 64, no held-out text


def teacher_flags(**kw) -> list[str]:
    from surgery.commands.teacher import TEACHER_OPTIONS

    return cli_args({k: v for k, v in (RUN | kw).items() if k in TEACHER_OPTIONS})


def make_store(teacher: Path, out: Path, k: int) -> Path:
    teacher_pass(str(teacher), out, UptrainOptions(model=str(teacher), out=out, **RUN), k, device="cpu",
                 progress=False)
    return out


def run(student: Path, out: Path, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(student), out=out, **(RUN | kw)))


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    return make_store(tiny, tmp_path_factory.mktemp("stores") / "k8", 8)


@pytest.fixture(scope="module")
def kept_run(student, store, tmp_path_factory):
    """A finished one-step run from the store whose run folder (a checkpoint at each step) is kept."""
    out = tmp_path_factory.mktemp("kept") / "out"
    record = run(student, out, teacher_logprobs=str(store), save_every=1, keep_run_dir=True)
    return out, record


def copy_run(kept_run, tmp_path) -> tuple[Path, Path]:
    """The kept run's folder copied beside a fresh OUT (no output yet): a run to --resume."""
    out = tmp_path / "out"
    shutil.copytree(kept_run[0].parent / "out.run", tmp_path / "out.run", symlinks=True)
    return out, tmp_path / "out.run"


# ------------------------------------------------------------------------------------------------------ data loss
def test_force_never_deletes_a_data_file_inside_the_output(tiny, student, tmp_path, cli):
    """`surgery teacher --force --out DIR` with --data DIR/text.txt deleted the text it had just read."""
    from surgery.data import pydoc_texts

    folder = tmp_path / "texts"
    folder.mkdir()
    text = folder / "text.txt"
    text.write_text("\n\n".join(pydoc_texts()[:300]))
    code, _, err = cli("teacher", tiny, "--out", folder, "--force", "--top-k", 4, "--device", "cpu",
                       *teacher_flags(data=text))
    assert code == 2 and "contains the --data text file" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SurgeryError, match="contains the --data text file") as e:
        run(student, folder, data=str(text), force=True, teacher=str(tiny))
    one_line(e)
    code, _, err = cli("teacher", tiny, "--out", folder / "store", "--force", "--top-k", 4, "--device", "cpu",
                       *teacher_flags(data=str(folder / "*.txt")))  # a glob's files are inputs too: not inside
    assert code == 0, err
    assert text.read_text().startswith(pydoc_texts()[0][:50])


def test_resume_never_follows_a_link_out_of_the_run_folder(kept_run, student, store, tmp_path):
    """A symlinked metrics.jsonl was rewritten (the file it points to, outside the run); a run folder that is a link
    was a traceback."""
    out, run_dir = copy_run(kept_run, tmp_path)
    outside = tmp_path / "precious.txt"
    outside.write_text("not a metrics file\n")
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(SurgeryError, match="holds a symbolic link metrics.jsonl") as e:
        run(student, out, teacher_logprobs=str(store), save_every=1, resume=True)
    one_line(e)
    assert outside.read_text() == "not a metrics file\n" and not out.exists()
    real = tmp_path / "elsewhere"
    (run_dir / "metrics.jsonl").unlink()
    run_dir.rename(real)
    run_dir.symlink_to(real, target_is_directory=True)
    for resume in (True, False):
        with pytest.raises(SurgeryError, match="is a symbolic link") as e:
            run(student, out, teacher_logprobs=str(store), save_every=1, resume=resume, force=True)
        one_line(e)
    assert (real / "run.json").is_file() and not out.exists()


def test_resume_never_writes_through_a_hard_link_in_the_run_folder(kept_run, student, store, tmp_path):
    """metrics.jsonl was rewritten in place: a hard link's other name (outside the run) got the run's lines."""
    out, run_dir = copy_run(kept_run, tmp_path)
    outside = tmp_path / "precious.txt"
    outside.write_text("not a metrics file\n")
    (run_dir / "metrics.jsonl").unlink()
    os.link(outside, run_dir / "metrics.jsonl")
    record = run(student, out, teacher_logprobs=str(store), save_every=1, resume=True)
    assert record["steps"] == 1 and outside.read_text() == "not a metrics file\n"


# ------------------------------------------------------------------------------------------------------- security
def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def assert_no_machine_path(record: dict) -> None:
    home = str(Path.home())
    for text in _strings(public_record(record)):
        assert not text.startswith(("/", "~", "\\")) and " /" not in text and home not in text, text


def test_the_public_record_names_no_place_on_this_machine(kept_run, tmp_path):
    """`uptraining.teacher_logprobs.folder` was published as the machine's path; now every text of the record is
    checked, whatever its key."""
    out, record = kept_run
    assert Path(record["teacher_logprobs"]["folder"]).is_absolute()  # the local record keeps it (for this machine)
    assert_no_machine_path(read_record(out))
    assert public_record(read_record(out))["uptraining"]["teacher_logprobs"]["folder"] == "k8"
    made_up = {"kind": "mqa", "later_field": {"path": str(Path.home() / "secret" / "x.bin"),
                                              str(tmp_path / "key.txt"): "C:\\Users\\bob\\model",
                                              "note": f"read from {tmp_path}/data.txt and ~/notes"},
               "hub": "hf://datasets/org/name", "pair": "q_proj/k_proj"}
    public = public_record(made_up)
    assert_no_machine_path(made_up)
    assert public["later_field"]["path"] == "x.bin" and public["later_field"]["key.txt"] == "model"
    assert public["hub"] == "hf://datasets/org/name" and public["pair"] == "q_proj/k_proj"


# ------------------------------------------------------------------------------------------- stores as distributions
def _edit_shard(change):
    def edit(store: Path) -> None:
        from safetensors.torch import load_file, save_file

        from surgery.checkpoint.sha256 import sha256_file

        m = json.loads((store / "manifest.json").read_text())
        path = store / m["shards"][0]["file"]
        shard = load_file(path)
        change(shard)
        save_file(shard, path, metadata={"format": "surgery-teacher-logprobs/1"})
        m["shards"][0]["sha256"] = sha256_file(path)  # an edit that keeps the store's own checks happy
        (store / "manifest.json").write_text(json.dumps(m))
    return edit


def _nan_at_one_position(s):
    s["logprobs"][3, 5, 0] = float("nan")


def _same_id_everywhere(s):
    s["ids"][:] = 7


def _id_beyond_vocabulary(s):
    s["ids"][0, 0, 1] = 100_000


def _mass_above_one(s):
    s["logprobs"][:] = s["logprobs"] + 1


def _window_hashes_of_other_text(s):
    s["window_hash"][:] = s["window_hash"] + 1


@pytest.mark.parametrize("change, fragment", [
    (_nan_at_one_position, "log-probabilities that are not numbers (1 NaN"),
    (_same_id_everywhere, "the same token id twice at one position"),
    (_id_beyond_vocabulary, "token id 100000, outside the teacher's vocabulary of 320"),
    (_mass_above_one, "probabilities that sum to"),
])
def test_a_store_that_is_no_distribution_is_refused_before_the_first_step(student, store, tmp_path, change, fragment):
    """Each was trained on with exit 0 (NaN: a KD term of 0, nothing learned) or a traceback (an id beyond the
    vocabulary)."""
    fake = tmp_path / "store"
    shutil.copytree(store, fake)
    _edit_shard(change)(fake)
    with pytest.raises(SurgeryError, match=None) as e:
        run(student, tmp_path / "o", teacher_logprobs=str(fake))
    assert fragment in one_line(e)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()


def test_a_deeply_nested_store_manifest_is_one_line(student, store, tmp_path):
    """json.loads' RecursionError was a traceback."""
    fake = tmp_path / "store"
    shutil.copytree(store, fake)
    (fake / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SurgeryError, match="manifest.json nests deeper than 100 levels") as e:
        run(student, tmp_path / "o", teacher_logprobs=str(fake))
    one_line(e)


def test_teacher_refuses_a_temperature_that_makes_nans_and_writes_nothing(tiny, tmp_path, cli):
    code, _, err = cli("teacher", tiny, "--out", tmp_path / "s", "--top-k", 4, "--device", "cpu",
                       *teacher_flags(temperature=1e-300))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--temperature 1e-300 gives log-probabilities that are not numbers" in err
    assert not (tmp_path / "s").exists() and not any(p.name.startswith(".s.") for p in tmp_path.iterdir())


# ------------------------------------------------------------------------------------- what --resume must repeat
def test_resume_refuses_another_store_at_the_same_path_and_another_precision(kept_run, student, tiny, tmp_path):
    """Both went on (steps from one store, then the other; one precision, then another) and recorded one."""
    out, run_dir = copy_run(kept_run, tmp_path)
    store = tmp_path / "store"
    shutil.copytree(Path(kept_run[1]["teacher_logprobs"]["folder"]), store)
    saved = json.loads((run_dir / "run.json").read_text())
    saved["teacher_logprobs"] = str(store)  # the same store, moved: the same identity
    (run_dir / "run.json").write_text(json.dumps(saved))
    with pytest.raises(SurgeryError, match=r"different options .*precision: 'fp32' -> 'bf16'") as e:
        run(student, out, teacher_logprobs=str(store), save_every=1, resume=True, precision="bf16")
    one_line(e)
    shutil.rmtree(store)
    make_store(tiny, store, 4)  # another store (K = 4) at the same path
    with pytest.raises(SurgeryError, match="different options .*teacher_logprobs_store") as e:
        run(student, out, teacher_logprobs=str(store), save_every=1, resume=True)
    one_line(e)
    assert not out.exists()


# --------------------------------------------------------------------------------------------------- left behind
def test_a_run_refused_at_its_first_step_leaves_nothing_that_blocks_the_corrected_command(student, store, tmp_path):
    """The run folder with run.json and no checkpoint was left, and the corrected command refused ("holds an earlier
    run")."""
    fake = tmp_path / "other-windows"
    shutil.copytree(store, fake)
    _edit_shard(_window_hashes_of_other_text)(fake)
    with pytest.raises(SurgeryError, match="not the ones this run trains on") as e:
        run(student, tmp_path / "o", teacher_logprobs=str(fake))
    one_line(e)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()
    record = run(student, tmp_path / "o", teacher_logprobs=str(store))  # no --force needed
    assert record["steps"] == 1


@pytest.mark.parametrize("chat_template", ["off", "auto"])  # the tiny Llama's tokenizer has no chat template
def test_loss_on_assistant_without_a_template_counts_the_assistant_turns_only(tiny, tokenizer, tmp_path,
                                                                              chat_template):
    """The issue saw every token trained on; conversations without a template are their turns' contents, and the
    mask keeps the assistant's (a correct run whose record says loss_on assistant and the template mode)."""
    from surgery.training.loop import setup

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Explain the thing number {i} please. " * 3},
        {"role": "assistant", "content": f"def answer_{i}(x):\n    return x * {i}\n"}]}) + "\n" for i in range(200)))
    recipe = setup(UptrainOptions(model=str(tiny), out=tmp_path / "o", **(FAST | dict(
        data=[str(data)], tokens=512, loss="lm", data_mode="packed", loss_on="assistant",
        chat_template=chat_template))))
    ids, mask = recipe.data.windows.train, recipe.data.windows.train_mask.bool()
    trained = tokenizer.decode(ids[mask].tolist())
    assert 0 < mask.float().mean() < 0.7 and "Explain" not in trained and "please" not in trained
    assert "def answer_" in trained and "return x *" in trained


# ------------------------------------------------------------------------------------------- ignored options, API
@pytest.mark.parametrize("options, fragment", [
    (dict(gen_tokens=16), "--gen-tokens sets the student's generations: it needs --on-policy"),
    (dict(gen_temperature=0.5), "--gen-temperature sets the student's generations: it needs --on-policy"),
    (dict(loss="lm", kd_divergence="jsd", kd_beta=0.2), "--kd-beta shapes the KD term: --loss lm has none"),
    (dict(loss="lm", kd_divergence="reverse"), "--kd-divergence shapes the KD term: --loss lm has none"),
    (dict(on_policy=0.5, gen_tokens=16, gen_temperature=1e-300), "--gen-temperature 1e-300 is greedy in all but"),
])
def test_options_that_would_be_ignored_or_underflow_are_refused(options, fragment):
    with pytest.raises(SurgeryError, match=None) as e:
        UptrainOptions(model="x", out=Path("o"), **(RUN | options))
    assert fragment in one_line(e)


@pytest.mark.parametrize("ref, fragment", [
    ("uptrain", "names this step itself"),
    ("convert", "names step 'convert', which is not a teacher step"),
    ("teachr", "names no teacher step ('convert', 'uptrain') and no folder 'teachr'"),
])
def test_a_recipe_step_reading_a_store_of_no_teacher_step_fails_its_dry_run(tmp_path, ref, fragment):
    from recipe_files import write_recipe
    from surgery.recipes import load_recipe
    from surgery.recipes.plan import build_plan

    data = {"name": "t", "source": {"id": "smollm2"}, "output": "out",
            "steps": [{"convert": {"to": "mqa"}},
                      {"uptrain": {"tokens": 1024, "seq_len": 256, "batch_tokens": 512, "micro_batch": 2,
                                   "loss": "kd", "teacher_logprobs": ref}}]}
    with pytest.raises(SurgeryError, match=None) as e:
        build_plan(load_recipe(write_recipe(tmp_path / "r.yaml", data)), tmp_path / "out")
    assert fragment in one_line(e) and "teacher_logprobs" in str(e.value)


@pytest.mark.parametrize("function, options, fragment", [
    ("uptrain", dict(eval_tokens="all of them"), "--eval-tokens: Input should be a valid integer"),
    ("uptrain", dict(data_epochs=[2]), "--data-epochs: Input should be a valid integer"),
    ("uptrain", dict(tokens=1.5), "--tokens: Input should be a valid integer"),
    ("convert", dict(calib_tokens="many"), "--calib-tokens: Input should be a valid integer"),
])
def test_the_api_checks_the_sizes_of_data_objects_by_their_types(tmp_path, function, options, fragment):
    """Text for an integer option was a TypeError from inside (str + int) or a string repeated as a number."""
    import surgery.api as api

    docs = ["def f(x):\n    return x\n"] * 4
    with pytest.raises(SurgeryError, match=None) as e:
        if function == "uptrain":
            api.uptrain("smollm2", tmp_path / "o", data=docs, **({"tokens": 1024} | options))
        else:
            api.convert("smollm2", tmp_path / "o", to="mqa", calib=docs, **options)
    assert fragment in one_line(e)
    assert not (tmp_path / "o").exists()


def test_the_api_reads_a_generator_of_documents_and_refuses_a_column_that_is_not_text(tiny, tmp_path):
    """A generator was taken for a list of hub dataset names ("Couldn't reach 'one document' on the Hub"); numbers
    in the text column were a TypeError from inside the tokenizer."""
    import itertools

    import datasets

    import surgery.api as api
    from surgery.api.sources import text_specs

    endless = (f"def f{i}(x):\n    return x + {i}\n" for i in itertools.count())
    [spec] = text_specs(endless, "text", 100)  # read up to the tokens needed, never to the end
    rows = [json.loads(line) for line in Path(spec).read_text().splitlines()]
    assert rows[:2] == [{"text": "def f0(x):\n    return x + 0\n"}, {"text": "def f1(x):\n    return x + 1\n"}]
    for data in (datasets.Dataset.from_dict({"text": [1, 2, 3]}), [{"text": ["a list"]}]):
        with pytest.raises(SurgeryError, match="row 0's 'text' is not text but") as e:
            api.uptrain(tiny, tmp_path / "o", data=data, tokens=512)
        one_line(e)
    assert not (tmp_path / "o").exists()


def test_a_loaded_model_whose_save_raises_is_one_line(tiny, tmp_path):
    import transformers as tf

    import surgery.api as api

    model = tf.AutoModelForCausalLM.from_pretrained(tiny)

    def broken(*args, **kw):
        raise RuntimeError("disk quota exceeded\nmore detail")

    model.save_pretrained = broken
    with pytest.raises(SurgeryError, match="save_pretrained failed: RuntimeError: disk quota exceeded") as e:
        api.convert(model, tmp_path / "o", to="mqa", kv_heads=1)
    one_line(e)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ on-policy, checkpoints
class NoCache(torch.nn.Module):
    """A causal LM that returns no KV cache (as some remote-code models do): generation must read the whole
    sequence at each token."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, use_cache=False, past_key_values=None):
        out = self.model(input_ids=input_ids, use_cache=False)
        out.past_key_values = None
        return out


def test_generation_from_a_model_without_a_kv_cache_reads_the_whole_sequence(tiny):
    """Each token was predicted from the previous token alone (the cache it fed back was None)."""
    import transformers as tf

    from surgery.training.onpolicy import generate

    model = tf.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    prompt = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cached, uncached = generate(model, prompt, 8), generate(NoCache(model), prompt, 8)
        by_hand = prompt
        for _ in range(8):
            by_hand = torch.cat([by_hand, model(input_ids=by_hand).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(uncached, by_hand[:, 10:]) and torch.equal(cached, uncached)


def test_a_pickle_in_place_of_the_optimizer_state_is_one_line_and_never_runs(kept_run, student, store, tmp_path):
    """A pickle with its size and sha256 in the checkpoint's manifest: safetensors' own error was a traceback."""
    from surgery.checkpoint.sha256 import sha256_file

    out, run_dir = copy_run(kept_run, tmp_path)
    for step in sorted((run_dir / "checkpoints").iterdir())[:-1]:
        shutil.rmtree(step)
    ckpt = sorted((run_dir / "checkpoints").iterdir())[-1]
    marker = tmp_path / "ran"
    optimizer = ckpt / "optimizer.safetensors"
    optimizer.write_bytes(pickle.dumps(_Marker(marker)))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["optimizer.safetensors"] |= {"size": optimizer.stat().st_size, "sha256": sha256_file(optimizer)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SurgeryError, match="cannot read checkpoint") as e:
        run(student, out, teacher_logprobs=str(store), save_every=1, resume=True)
    one_line(e)
    assert not marker.exists() and not out.exists()


class _Marker:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_tracker_shadowed_by_a_bare_folder_is_one_line(tmp_path, monkeypatch):
    """A folder named like a tracker that is not installed (its run folder, say) was found as a package: the run went
    on with no tracker and accelerate's raw warning."""
    import importlib.util

    from surgery.training.trackers import require_trackers

    missing = next((n for n in ("trackio", "mlflow", "wandb") if importlib.util.find_spec(n) is None), None)
    if missing is None:
        pytest.skip("every tracker is installed here: none to shadow")
    (tmp_path / missing).mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SurgeryError, match=f"--report-to {missing} needs the {missing} package: pip install") as e:
        require_trackers([missing])
    assert f"a folder {missing} on the import path is not it" in one_line(e)
