"""The stored teacher pass (`surgery teacher`, surgery/training/teacher_pass.py) and distillation from it
(`surgery uptrain --teacher-logprobs`, surgery/training/stored_kd.py) on the tiny pydoc Llama (320 ids)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST, metrics, weights
from surgery.training import UptrainOptions, uptrain
from surgery.training.losses import kd_loss
from surgery.training.stored_kd import stored_kd_loss
from surgery.training.teacher_pass import teacher_pass
from surgery.training.teacher_store import StoredTargets, TeacherStore, bytes_per_token

from inprocess import cli_args, uptrain_error

RUN = FAST | dict(tokens=512 * 3, loss="kd")  # three steps of 8 windows of 64


def teacher_args(**kw) -> list[str]:
    """`surgery teacher`'s flags for RUN's windows (it takes uptrain's data options only)."""
    from surgery.commands.teacher import TEACHER_OPTIONS

    return cli_args({k: v for k, v in (RUN | kw).items() if k in TEACHER_OPTIONS})


def make_store(teacher: Path, out: Path, k: int, **kw) -> TeacherStore:
    o = UptrainOptions(model=str(teacher), out=out, **(RUN | kw))
    teacher_pass(str(teacher), out, o, k, device="cpu", progress=False)
    return TeacherStore(out)


def run(student: Path, out: Path, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(student), out=out, **(RUN | kw)))


@pytest.fixture(scope="module")
def store32(tiny, tmp_path_factory):
    return make_store(tiny, tmp_path_factory.mktemp("stores") / "k32", 32)


def run_windows(teacher: Path, tokenizer, **kw) -> torch.Tensor:
    """The windows `uptrain` trains on with RUN's options, in its order, as its packed data path yields them."""
    from surgery.data import load_texts
    from surgery.training.data import pack

    o = UptrainOptions(model=str(teacher), out=Path("unused"), **(RUN | kw))
    data = pack(load_texts(o.data[0]), tokenizer, o.seq_len, o.eval_tokens,
                o.total_steps * o.sequences_per_step * o.seq_len, seed=o.seed)
    return torch.cat([data.step_batch(s, o.sequences_per_step, 0, 1) for s in range(o.total_steps)])


def test_store_holds_the_live_teachers_top_k_on_the_runs_windows(tiny, tokenizer, store32):
    import transformers as tf

    from surgery.training.teacher_store import window_hash

    m = store32.manifest
    assert m["top_k"] == 32 and m["windows"] == 24 and m["bytes_per_token"] == bytes_per_token(32) == 194
    assert m["windows_spec"]["seq_len"] == 64 and m["windows_spec"]["seed"] == 0 and m["vocab"] == 320
    assert len(m["teacher"]["weights"]["model.safetensors"]) == 64  # sha256 of its weights
    stored = store32.read(0, 24)
    ids = run_windows(tiny, tokenizer)
    assert torch.equal(stored.hashes, window_hash(ids))  # the run's own windows, in its order
    model = tf.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=ids).logits.float(), -1)
    top, top_ids = logp.topk(32, -1)
    # the same top-32 (a near-tie of a random model may swap between batch shapes): the stored ids' live log-probs
    # are the stored ones, and they are the 32 largest
    assert (stored.ids.long() == top_ids).float().mean() > 0.95
    assert torch.allclose(logp.gather(-1, stored.ids.long()), stored.logprobs.float(), atol=2e-3, rtol=1e-3)  # fp16
    assert torch.allclose(stored.logprobs.float(), top, atol=2e-3, rtol=1e-3)
    rest = torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7))
    assert torch.allclose(stored.tail.float(), rest, atol=2e-3, rtol=1e-3)
    # shards are read by slices: a window range across a shard boundary equals the whole read's rows
    assert torch.equal(store32.read(5, 3).logprobs, stored.logprobs[5:8])


def test_stored_loss_is_the_divergence_over_the_top_k_buckets_and_live_kd_at_full_vocabulary():
    from surgery.training.teacher_pass import top_k_of

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g, dtype=torch.float64), 2 * torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    for temperature in (1.0, 2.0):
        full = StoredTargets(*top_k_of(t, 11, temperature), torch.zeros(2))
        assert stored_kd_loss(s, full, temperature).item() == pytest.approx(kd_loss(s, t, temperature).item(), rel=1e-5)
    lp, ids, tail = top_k_of(t, 3)
    targets = StoredTargets(lp, ids, tail, torch.zeros(2))
    p_t, p_s = F.softmax(t, -1), F.softmax(s, -1)  # by hand: the 3 ids and one bucket for the rest
    mask = torch.zeros_like(p_t, dtype=torch.bool).scatter(-1, ids, True)
    bt = torch.cat([p_t.gather(-1, ids), (p_t * ~mask).sum(-1, keepdim=True)], -1)
    bs = torch.cat([p_s.gather(-1, ids), (p_s * ~mask).sum(-1, keepdim=True)], -1)
    expected = (bt * (bt.log() - bs.log())).sum(-1).mean()
    assert stored_kd_loss(s, targets).item() == pytest.approx(expected.item(), rel=1e-5)
    assert stored_kd_loss(s, targets).item() < kd_loss(s, t).item()  # coarser than the full divergence
    reverse = (bs * (bs.log() - bt.log())).sum(-1).mean()
    assert stored_kd_loss(s, targets, divergence="reverse").item() == pytest.approx(reverse.item(), rel=1e-5)
    x = s.clone().requires_grad_()
    stored_kd_loss(x, targets).backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_uptrain_from_a_full_vocabulary_store_matches_live_kd(tiny, student, tmp_path):
    """K = V: the stored KD loss is the live forward-KL loss, up to the store's fp16 log-probs."""
    make_store(tiny, tmp_path / "k320", 320)
    live = run(student, tmp_path / "live", teacher=str(tiny))
    stored = run(student, tmp_path / "stored", teacher_logprobs=str(tmp_path / "k320"))
    a = [m["kd_loss"] for m in metrics(tmp_path / "live") if "kd_loss" in m]
    b = [m["kd_loss"] for m in metrics(tmp_path / "stored") if "kd_loss" in m]
    assert len(a) == len(b) == 3 and a[0] > 0.01
    assert b == pytest.approx(a, rel=2e-3)
    assert stored["teacher_logprobs"]["top_k"] == 320 and stored["teacher"] is None and live["teacher"]
    assert stored["final_eval_ppl"] == pytest.approx(live["final_eval_ppl"], rel=1e-3)
    w0, wa, wb = weights(student), weights(tmp_path / "live"), weights(tmp_path / "stored")
    da, db = (torch.cat([(w[k] - w0[k]).flatten() for k in sorted(w0)]) for w in (wa, wb))
    assert F.cosine_similarity(da, db, dim=0) > 0.99  # the same updates (Adam magnifies fp16-sized differences)


def test_uptrain_from_a_top_32_store_tracks_live_kd_and_resumes_bitwise(tiny, student, store32, tmp_path):
    live = run(student, tmp_path / "live", teacher=str(tiny))
    stored = run(student, tmp_path / "stored", teacher_logprobs=str(store32.folder), save_every=1, keep_run_dir=True)
    a = [m["kd_loss"] for m in metrics(tmp_path / "live") if "kd_loss" in m]
    b = [m["kd_loss"] for m in metrics(tmp_path / "stored") if "kd_loss" in m]
    # the same first step (same weights): the 33-bucket divergence is below the full one (a random teacher is close
    # to uniform, so its top-32 hold a small part of it), and training on it moves the student as live KD does
    assert 0 < b[0] < a[0], (a, b)
    assert stored["final_eval_ppl"] < stored["initial_eval_ppl"] and live["final_eval_ppl"] < live["initial_eval_ppl"]
    run_dir = tmp_path / "stored.run"
    for step in (1, 2):  # a run killed after `step`: resumed, it reads the store on from its step
        copy = tmp_path / f"resumed{step}.run"
        shutil.copytree(run_dir, copy)
        for ckpt in (copy / "checkpoints").iterdir():
            if int(ckpt.name.split("-")[1]) > step:
                shutil.rmtree(ckpt)
        run(student, tmp_path / f"resumed{step}", teacher_logprobs=str(store32.folder), save_every=1, resume=True,
            run_dir=copy)
        wa, wb = weights(tmp_path / "stored"), weights(tmp_path / f"resumed{step}")
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"resumed after step {step}"


def test_bf16_store_and_bf16_stored_kd(tiny, student, tmp_path):
    store = make_store(tiny, tmp_path / "bf16", 32, precision="bf16")
    assert store.manifest["precision"] == "bf16"
    fp32 = make_store(tiny, tmp_path / "fp32", 32)
    a, b = store.read(0, 24), fp32.read(0, 24)
    assert (a.ids[..., 0] == b.ids[..., 0]).float().mean() > 0.9  # bf16 rounding may swap near-ties
    assert (a.logprobs.float() - b.logprobs.float()).abs()[..., 0].median() < 0.05
    rec = run(student, tmp_path / "out", teacher_logprobs=str(tmp_path / "bf16"), precision="bf16")
    kd = [m["kd_loss"] for m in metrics(tmp_path / "out") if "kd_loss" in m]
    assert rec["precision"] == "bf16" and len(kd) == 3 and all(math.isfinite(x) and x > 0 for x in kd)


def test_refusals_are_one_line(tiny, student, store32, tokenizer, monkeypatch, capsys, cli, tmp_path):
    base = [student, "--out", tmp_path / "o", "--teacher-logprobs", store32.folder, *cli_args(RUN)]

    def error(*extra):
        return uptrain_error(monkeypatch, capsys, *base, *extra)

    assert "other training windows (--seed" in error("--seed", 1)
    assert "windows of 64 tokens; the run has --seq-len 32" in error("--seq-len", 32)
    assert "--tokens / --batch-tokens" in error("--tokens", 512 * 2)  # packed: fewer tokens pack other windows
    text = tmp_path / "text.txt"
    from surgery.data import pydoc_texts

    text.write_text("\n\n".join(pydoc_texts()[:200]))
    assert "other training windows (--data" in error("--data", text)
    assert "needs --loss kd or mix" in error("--loss", "lm")
    assert "not both" in error("--teacher", tiny)
    assert "--temperature 1.0; the run has --temperature 2.0" in error("--temperature", 2.0)
    (tmp_path / "empty").mkdir()
    assert "not a teacher store" in uptrain_error(monkeypatch, capsys, student, "--out", tmp_path / "o",
                                                  "--teacher-logprobs", text.parent / "empty", *cli_args(RUN))
    # another tokenizer: the same vocabulary size, two ids swapped
    other = tmp_path / "other-tok"
    shutil.copytree(student, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert "another tokenizer" in uptrain_error(monkeypatch, capsys, other, *base[1:])
    # streamed: a longer run than the store holds
    streamed = tmp_path / "stream-store"
    code, _, err = cli("teacher", tiny, "--out", streamed, "--top-k", 4, "--device", "cpu",
                       *teacher_args(data_mode="stream"))
    assert code == 0, err
    assert "the run needs 32" in uptrain_error(monkeypatch, capsys, student, "--out", tmp_path / "o",
                                               "--teacher-logprobs", streamed,
                                               *cli_args(RUN | dict(data_mode="stream", tokens=512 * 4)))
    # the teacher command's own refusals
    code, _, err = cli("teacher", tiny, "--out", tmp_path / "t", "--top-k", 321, "--device", "cpu", *teacher_args())
    assert code == 2 and "more than the teacher's 320 logits" in err and not (tmp_path / "t").exists()
    code, _, err = cli("teacher", tiny, "--out", store32.folder, "--top-k", 4, "--device", "cpu", *teacher_args())
    assert code == 2 and "already exists" in err


def test_a_streamed_store_serves_a_shorter_run_and_checks_each_window(tiny, student, tmp_path, cli):
    store = tmp_path / "s"
    code, out, err = cli("teacher", tiny, "--out", store, "--top-k", 8, "--device", "cpu",
                         *teacher_args(data_mode="stream"))
    assert code == 0, err
    assert "50 B/token" in out
    assert len(list(store.glob("shard-*.safetensors"))) == 1
    other = tmp_path / "other.txt"  # a .txt --eval-data: held out, it changes no training window
    other.write_text("def f(x):\n    return x + 1\n\n" * 200)
    rec = run(student, tmp_path / "o", teacher_logprobs=str(store), data_mode="stream", tokens=512 * 2,
              eval_data=str(other))
    assert rec["steps"] == 2 and rec["teacher_logprobs"]["windows"] == 24 and rec["final_other_eval_ppl"] > 1
    # a store whose windows were made from other text: its shard's sha256 differs from the manifest's
    from safetensors.torch import load_file, save_file

    from surgery.checkpoint.sha256 import sha256_file

    m = json.loads((store / "manifest.json").read_text())
    fake = tmp_path / "fake"
    shutil.copytree(store, fake)
    shard = load_file(fake / m["shards"][0]["file"])
    shard["window_hash"] = shard["window_hash"] + 1
    save_file(shard, fake / m["shards"][0]["file"])
    with pytest.raises(SurgeryError, match="its sha256 differs"):
        run(student, tmp_path / "o2", teacher_logprobs=str(fake), data_mode="stream", tokens=512 * 2)
    # ... and with its manifest edited to match: each window's hash is still checked against the run's tokens
    m["shards"][0]["sha256"] = sha256_file(fake / m["shards"][0]["file"])
    (fake / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SurgeryError, match="not the ones this run trains on"):
        run(student, tmp_path / "o3", teacher_logprobs=str(fake), data_mode="stream", tokens=512 * 2)
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_dry_run_states_the_stores_size_and_no_teacher(student, store32, cli):
    code, out, err = cli("uptrain", student, "--dry-run", "--teacher-logprobs", store32.folder, *cli_args(RUN))
    assert code == 0, err
    assert "stored top-32 (194 B/token" in out and "291.0 KiB for this run's 1,536 tokens" in out
    assert "teacher: none in memory" in out and "teacher (" not in out
    code, out, err = cli("uptrain", student, "--dry-run", "--teacher-logprobs", store32.folder / "later",
                         *cli_args(RUN | dict(tokens=49152, batch_tokens=4096)))
    assert code == 0 and "9.1 MiB for this run's 49,152 tokens" in out and "not made yet" in out


def _edit_manifest(**fields):
    def edit(store: Path) -> None:
        m = json.loads((store / "manifest.json").read_text())
        for key, value in fields.items():
            if key.startswith("shard0_"):
                m["shards"][0][key.removeprefix("shard0_")] = value
            else:
                m[key] = value
        (store / "manifest.json").write_text(json.dumps(m))
    return edit


def _truncate(store: Path) -> None:
    shard = sorted(store.glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])


@pytest.mark.parametrize("tamper, fragment", [
    (_edit_manifest(top_k="32"), "top_k is '32'"),
    (_edit_manifest(windows=-1), "windows is -1"),
    (_edit_manifest(shards="shard-00000.safetensors"), "shards is"),
    (_edit_manifest(shards=[]), "shards"),
    (_edit_manifest(shard0_file="../../etc/passwd"), "not one `surgery teacher` writes"),
    (_edit_manifest(shard0_first=1), "not consecutive"),
    (_edit_manifest(shard0_sha256=None), "sha256 is None"),
    (_edit_manifest(tokens=7), "says 7 tokens"),
    (_edit_manifest(top_k=8), "does not hold the windows its manifest lists"),
    (lambda s: sorted(s.glob("shard-*"))[0].unlink(), "cannot read shard-00000"),
    (_truncate, "truncated or edited"),
])
def test_a_tampered_store_is_refused_before_any_step(student, store32, tmp_path, tamper, fragment):
    """Each was a KeyError/TypeError from inside, a read outside the store, or (an edited shard) training on
    other targets with exit 0."""
    fake = tmp_path / "store"
    shutil.copytree(store32.folder, fake)
    tamper(fake)
    with pytest.raises(SurgeryError, match=None) as e:
        run(student, tmp_path / "o", teacher_logprobs=str(fake))
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()  # refused before the run began
