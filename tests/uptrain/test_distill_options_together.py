"""The distillation options of issue 41 beside each other and beside chat data: the stored teacher pass
(--teacher-logprobs), on-policy distillation (--on-policy), GKD's --kd-beta and --loss-on assistant / --chat-template.
Each pair either works and computes what each does alone, or is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from surgery.errors import SurgeryError
from surgery.training import UptrainOptions
from surgery.training.losses import kd_loss
from surgery.training.stored_kd import stored_kd_loss
from surgery.training.teacher_pass import top_k_of
from surgery.training.teacher_store import StoredTargets, spec_difference, windows_spec


def logits(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 6, 13, generator=g, dtype=torch.float64),
            2 * torch.randn(2, 6, 13, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_stored_generalized_jsd_is_the_live_one_at_full_vocabulary(beta):
    """K = V: the store's buckets are the vocabulary, so --kd-divergence jsd --kd-beta B from the store is GKD's
    generalized JSD of the live teacher, at every beta (0 and 1: forward and reverse KL)."""
    s, t = logits(1)
    full = StoredTargets(*top_k_of(t, 13), torch.zeros(2))
    live = kd_loss(s, t, divergence="jsd", beta=beta)
    stored = stored_kd_loss(s, full, divergence="jsd", beta=beta)
    assert stored.item() == pytest.approx(live.item(), rel=1e-6)
    if beta in (0.0, 1.0):
        other = stored_kd_loss(s, full, divergence="forward" if beta == 0 else "reverse")
        assert stored.item() == pytest.approx(other.item(), rel=1e-9)


@pytest.mark.parametrize("divergence", ["forward", "reverse", "jsd"])
def test_stored_kd_counts_only_the_assistant_positions(divergence):
    """--loss-on assistant with a store: the mean over the positions that predict a marked token, as live KD does."""
    s, t = logits(2)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 2:4] = True
    mask[1, 5] = True
    targets = StoredTargets(*top_k_of(t, 4), torch.zeros(2))
    keep = torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False)  # position i predicts token i + 1
    rows = keep.nonzero(as_tuple=True)
    alone = StoredTargets(targets.logprobs[rows][None], targets.ids[rows][None], targets.tail[rows][None],
                          torch.zeros(1))
    expected = stored_kd_loss(s[rows][None], alone, divergence=divergence)
    got = stored_kd_loss(s, targets, divergence=divergence, mask=mask)
    assert got.item() == pytest.approx(expected.item(), rel=1e-9)
    assert got.item() != pytest.approx(stored_kd_loss(s, targets, divergence=divergence).item(), rel=1e-3)
    # the live KD term masks the same positions
    full = StoredTargets(*top_k_of(t, 13), torch.zeros(2))
    assert stored_kd_loss(s, full, divergence=divergence, mask=mask).item() == pytest.approx(
        kd_loss(s, t, divergence=divergence, mask=mask).item(), rel=1e-6)
    none = torch.zeros_like(mask)
    x = s.clone().requires_grad_()
    zero = stored_kd_loss(x, targets, divergence=divergence, mask=none)
    zero.backward()
    assert zero.item() == 0 and x.grad is not None


def test_on_policy_is_refused_beside_a_store_and_beside_assistant_only_loss():
    def refused(match, **kw):
        with pytest.raises(SurgeryError, match=match):
            UptrainOptions(model="x", out=Path("o"), tokens=1024, seq_len=128, batch_tokens=512, loss="kd", **kw)

    refused("--on-policy needs the live teacher .*--teacher-logprobs", on_policy=0.5, teacher_logprobs="store")
    refused("--on-policy .*not with --loss-on assistant", on_policy=0.5, loss_on="assistant")
    # each alone is accepted
    assert UptrainOptions(model="x", out=Path("o"), tokens=1024, seq_len=128, batch_tokens=512, loss="kd",
                          teacher_logprobs="store", kd_divergence="jsd", kd_beta=0.2).kd_beta == 0.2


def test_a_store_names_the_chat_rendering_of_its_windows(tokenizer):
    """Conversations rendered with or without the template are other windows: a store made with --chat-template off
    is refused for a run with it on, naming the flag."""
    o = lambda chat: UptrainOptions(model="x", out=Path("o"), tokens=1024, seq_len=64, batch_tokens=512,
                                    chat_template=chat)
    auto, off, on = (windows_spec(o(c), tokenizer, 1) for c in ("auto", "off", "on"))
    assert "chat_template" not in auto  # stores made before chat data still match their runs
    assert spec_difference(auto, auto) is None
    assert spec_difference(off, on) == "--chat-template: store 'off', run 'on'"


def test_a_streamed_store_for_two_processes_holds_each_process_s_windows_in_step_order(tiny, tokenizer, tmp_path):
    """`surgery teacher --processes 2` on streamed data: the store's window g = step x B + rank x B/2 + i is the i-th
    window process `rank` of a 2-process run streams at that step, as stored_kd.first_window reads it; a 1-process
    run is refused that store (its windows come in another order), naming the readers."""
    from surgery.training.stored_kd import first_window, open_for_run
    from surgery.training.stream import StreamedData
    from surgery.training.stream_held_out import hold_out
    from surgery.training.stream_sources import Plan, resolve_sources
    from surgery.training.teacher_pass import teacher_pass
    from surgery.training.teacher_store import TeacherStore, window_hash
    from surgery.testing.pydoc_llama import FAST

    o = UptrainOptions(model=str(tiny), out=tmp_path / "store", **(FAST | dict(tokens=512 * 2, data_mode="stream")))
    teacher_pass(str(tiny), tmp_path / "store", o, 4, device="cpu", progress=False, processes=2)
    store = TeacherStore(tmp_path / "store")
    sources = resolve_sources(o.data, o.weights)
    args = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, seq_len=o.seq_len, seed=o.seed, readers=2,
                epochs=o.data_epochs, text_field=o.text_field, streaming=o.streaming, txt_unit=o.txt_unit,
                chat_template=o.chat_template)
    held_windows, held = hold_out(args, sources, o.eval_tokens)
    share = o.sequences_per_step // 2
    for rank in (0, 1):
        data = StreamedData(Plan(sources=tuple(sources), held=held, **args), held_windows, rank, 2, 0)
        for step in range(o.steps):
            ids = data.step_batch(step, o.sequences_per_step, rank, 2)
            stored = store.read(first_window(o, step, rank, 2), share)
            assert torch.equal(stored.hashes, window_hash(ids)), (rank, step)
        data.close()
    assert store.manifest["windows_spec"]["readers"] == 2

    import transformers as tf

    student = tf.AutoModelForCausalLM.from_pretrained(tiny)
    one = UptrainOptions(model=str(tiny), out=tmp_path / "o", teacher_logprobs=str(tmp_path / "store"), loss="kd",
                         **(FAST | dict(tokens=512 * 2, data_mode="stream", data_workers=0)))  # as the run resolves it
    with pytest.raises(SurgeryError, match="processes x --data-workers: store 2, run 1"):
        open_for_run(one, student, tokenizer, world=1)
    assert open_for_run(one, student, tokenizer, world=2).windows == store.windows


@pytest.mark.parametrize("divergence", ["forward", "reverse", "jsd"])
def test_position_weights_count_each_position_so_many_times_in_every_loss(divergence):
    """--retrieval-answer-weight's position weights: all ones are the plain means; a weight K at some positions adds
    (K - 1) times those positions' terms (each loss is linear in the weights), in the LM, the live and the stored KD
    terms alike, through the objective as the loop calls it."""
    from surgery.training.losses import Objective, lm_loss

    s, t = logits(2)
    ids = torch.randint(0, 13, (2, 6), generator=torch.Generator().manual_seed(3))
    stored = StoredTargets(*top_k_of(t, 4), torch.zeros(2))
    ones = torch.ones(2, 6, dtype=torch.float64)
    some = torch.zeros(2, 6, dtype=torch.float64)
    some[0, 2], some[1, 4] = 1, 1  # two answer positions
    losses = {"lm": lambda w: lm_loss(s, ids, weights=w),
              "kd": lambda w: Objective("kd", divergence=divergence)(s, ids, t, position_weights=w)[0],
              "stored": lambda w: stored_kd_loss(s, stored, divergence=divergence, weights=w)}
    plain = {"lm": lm_loss(s, ids), "kd": kd_loss(s, t, divergence=divergence),
             "stored": stored_kd_loss(s, stored, divergence=divergence)}
    for name, loss in losses.items():
        assert loss(ones).item() == pytest.approx(plain[name].item(), rel=1e-6)
        assert loss(ones + 7 * some).item() == pytest.approx((loss(ones) + 7 * loss(some)).item(), rel=1e-6)
        assert loss(some).item() > 0 and loss(ones + 7 * some).item() > plain[name].item()
