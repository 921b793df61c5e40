"""Chat data: a `messages` column rendered with the tokenizer's chat template (`--chat-template on|off|auto`) for
calibration (--calib) and uptraining (--data), on a local JSONL of conversations built from pydoc topics."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from surgery.calibration.text import calibration_text
from surgery.chat import ChatFormat
from surgery.data import load_texts
from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST
from surgery.training import UptrainOptions, uptrain

TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}")


def conversations(n: int = 40) -> list[dict]:
    from pydoc_data.topics import topics

    return [{"messages": [{"role": "user", "content": f"Explain {name}"},
                          {"role": "assistant", "content": topics[name]}]} for name in sorted(topics)[:n]]


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in conversations()))
    return path


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2):
    return tf.AutoTokenizer.from_pretrained(smollm2.folder)


def test_messages_are_rendered_with_the_template_or_joined(chat_jsonl, smol_tokenizer):
    first = conversations(1)[0]["messages"]
    on = next(iter(load_texts(str(chat_jsonl), chat=ChatFormat("auto", smol_tokenizer))))
    assert on == smol_tokenizer.apply_chat_template(first, tokenize=False)
    assert on.startswith("<|im_start|>system\n") and f"<|im_start|>assistant\n{first[1]['content']}<|im_end|>" in on
    off = next(iter(load_texts(str(chat_jsonl), chat=ChatFormat("off", smol_tokenizer))))
    assert off == f"{first[0]['content']}\n\n{first[1]['content']}"
    assert next(iter(load_texts(str(chat_jsonl)))) == off  # no chat format given: read plainly


def test_a_text_column_wins_only_when_the_template_is_off(tmp_path, smol_tokenizer):
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps({"text": "plain words", **conversations(1)[0]}) + "\n")
    assert list(load_texts(str(path), chat=ChatFormat("off", smol_tokenizer))) == ["plain words"]
    assert "<|im_start|>user\nExplain" in next(iter(load_texts(str(path), chat=ChatFormat("auto", smol_tokenizer))))


def test_chat_template_on_needs_a_template_and_bad_rows_are_one_line(tmp_path, tokenizer, smol_tokenizer):
    with pytest.raises(SurgeryError, match="--chat-template on: the tokenizer has no chat template"):
        ChatFormat("on", tokenizer)  # the tiny pydoc BPE tokenizer has none
    assert not ChatFormat("auto", tokenizer).templated
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(SurgeryError, match=r"a 'messages' row must be a non-empty list of \{role, content\} texts"):
        list(load_texts(str(path), chat=ChatFormat("auto", smol_tokenizer)))
    nothing = tmp_path / "none.jsonl"
    nothing.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(SurgeryError, match="has no column 'text' .*give conversations a 'messages' column"):
        list(load_texts(str(nothing)))


def test_calibration_windows_hold_the_template_s_tokens_only_when_on(chat_jsonl, smol_tokenizer):
    start = smol_tokenizer.convert_tokens_to_ids("<|im_start|>")
    on = calibration_text(str(chat_jsonl), smol_tokenizer, 1024, None, window=256)
    off = calibration_text(str(chat_jsonl), smol_tokenizer, 1024, None, window=256, chat_template="off")
    assert on.windows.shape == off.windows.shape == (4, 256)
    assert (on.windows == start).sum() >= 3 and (off.windows == start).sum() == 0
    expected = smol_tokenizer(smol_tokenizer.apply_chat_template(conversations(1)[0]["messages"], tokenize=False),
                              add_special_tokens=False)["input_ids"]
    assert on.windows.flatten()[:len(expected)].tolist() == expected[:1024]


def test_convert_takes_chat_template_and_refuses_on_without_a_template(cli, tiny, chat_jsonl, tmp_path):
    code, out, err = cli("convert", tiny, "--to", "mqa", "--merge", "aligned", "--calib", chat_jsonl,
                         "--calib-tokens", "256", "--chat-template", "on", "--out", tmp_path / "o")
    assert code == 2 and err.strip() == ("surgery: error: --chat-template on: the tokenizer has no chat template "
                                         "(chat_template in tokenizer_config.json or chat_template.jinja)")
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def tiny_chat(tiny, tmp_path_factory):
    """The tiny Llama with a chat template on its tokenizer (plain-text role markers its BPE can spell)."""
    folder = tmp_path_factory.mktemp("tiny-chat") / "m"
    shutil.copytree(tiny, folder)
    tok = tf.AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


def chat_run(model, out, data, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(FAST | dict(loss="lm", tokens=512 * 2, data=[str(data)],
                                                                            keep_run_dir=True) | kw)))


def test_uptrain_packs_rendered_conversations(tiny_chat, chat_jsonl, tmp_path):
    tok = tf.AutoTokenizer.from_pretrained(tiny_chat)
    chat_run(tiny_chat, tmp_path / "o", chat_jsonl, data_mode="packed")
    assert json.loads((tmp_path / "o.run" / "run.json").read_text())["chat_template"] == "auto"
    windows = load_file(str(tmp_path / "o.run" / "data.safetensors"))["eval"]
    text = tok.decode(windows.flatten().tolist())
    assert text.startswith("### user:\nExplain ") and "\n\n### assistant:\n" in text
    chat_run(tiny_chat, tmp_path / "off", chat_jsonl, data_mode="packed", chat_template="off")
    plain = tok.decode(load_file(str(tmp_path / "off.run" / "data.safetensors"))["eval"].flatten().tolist())
    assert plain.startswith("Explain ") and "### assistant" not in plain


def test_uptrain_streams_rendered_conversations(tiny, tiny_chat, chat_jsonl, tmp_path):
    on = chat_run(tiny_chat, tmp_path / "on", chat_jsonl, data_mode="stream")
    off = chat_run(tiny_chat, tmp_path / "off", chat_jsonl, data_mode="stream", chat_template="off")
    assert on["initial_eval_ppl"] != off["initial_eval_ppl"]  # other held-out tokens: the rendered conversations
    with pytest.raises(SurgeryError, match="--chat-template on: the tokenizer has no chat template"):
        chat_run(tiny, tmp_path / "n", chat_jsonl, chat_template="on")
    assert not (tmp_path / "n").exists() and not (tmp_path / "n.run").exists()


# ------------------------------------------------------------------------------------------ --loss-on assistant
def test_masked_losses_count_only_the_marked_targets():
    import torch.nn.functional as F

    from surgery.training.losses import kd_loss, lm_loss

    g = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(2, 6, 9, generator=g), torch.randn(2, 6, 9, generator=g)
    ids = torch.randint(0, 9, (2, 6), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    rows = [(b, p) for b in range(2) for p in range(5) if mask[b, p + 1]]  # position p predicts token p + 1
    manual = torch.stack([F.cross_entropy(logits[b, p], ids[b, p + 1]) for b, p in rows]).mean()
    assert lm_loss(logits, ids, mask=mask).item() == pytest.approx(manual.item(), rel=1e-6)
    s = torch.stack([logits[b, p] for b, p in rows])[:, None]
    t = torch.stack([teacher[b, p] for b, p in rows])[:, None]
    assert kd_loss(logits, teacher, mask=mask).item() == pytest.approx(kd_loss(s, t).item(), rel=1e-6)
    assert lm_loss(logits, ids, mask=mask).item() != pytest.approx(lm_loss(logits, ids).item(), rel=1e-3)


def test_assistant_spans_cover_the_answers_and_their_end_of_turn(smol_tokenizer):
    from surgery.chat import token_mask

    chat = ChatFormat("auto", smol_tokenizer, spans=True)
    messages = [{"role": "user", "content": "Explain X"}, {"role": "assistant", "content": "X is Y."},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "Z!"}]
    text = chat.render(messages, "test")
    assert [text[a:b] for a, b in text.assistant_spans] == ["X is Y.<|im_end|>\n", "Z!<|im_end|>\n"]
    ids, mask = token_mask(smol_tokenizer, text, text.assistant_spans)
    assert ids == smol_tokenizer(str(text), add_special_tokens=False)["input_ids"]
    assert smol_tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "X is Y.<|im_end|>\nZ!<|im_end|>\n"


def test_uptrain_loss_on_assistant_trains_on_the_assistant_tokens_only(tiny_chat, tmp_path):
    from surgery.training.data import PackedData
    from surgery.training.losses import lm_loss

    short = tmp_path / "short.jsonl"  # answers of ~50 tokens: every window holds turns of both roles
    short.write_text("".join(json.dumps({"messages": [m | {"content": m["content"][:200]} for m in c["messages"]]})
                             + "\n" for c in conversations(80)))
    tok = tf.AutoTokenizer.from_pretrained(tiny_chat)
    chat_run(tiny_chat, tmp_path / "o", short, data_mode="packed", loss_on="assistant", tokens=512,
             eval_every=0)
    cache = load_file(str(tmp_path / "o.run" / "data.safetensors"))
    data = PackedData(cache["train"], cache["eval"], seed=FAST.get("seed", 0), train_mask=cache["train_mask"])
    batch = data.step_batch(0, 8, 0, 1)  # 512 tokens / 64 per window
    mask = data.step_mask(0, 8, 0, 1)
    trained = tok.decode(batch[mask].tolist())
    assert "### assistant:" not in trained and "### user:" not in trained and "Explain " not in trained
    assert 0 < mask.sum() < mask.numel()
    first = json.loads((tmp_path / "o" / "uptrain_metrics.jsonl").read_text().splitlines()[1])  # step 1
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_chat, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    # a random model's losses are close to one another: the logged loss (7 digits) is the masked one to float
    # rounding, and the unmasked loss is farther from it than 20 times that
    masked, whole = lm_loss(logits, batch, mask=mask).item(), lm_loss(logits, batch).item()
    assert first["loss"] == pytest.approx(masked, rel=1e-6, abs=0)
    assert abs(first["loss"] - whole) > 20 * 1e-6 * whole
    with pytest.raises(SurgeryError, match="--loss-on assistant reads packed data: not with --data-mode stream"):
        chat_run(tiny_chat, tmp_path / "s", short, data_mode="stream", loss_on="assistant")


def test_chat_template_with_a_merge_that_reads_no_text_is_refused(cli, tiny, tmp_path):
    code, out, err = cli("convert", tiny, "--to", "mqa", "--chat-template", "off", "--out", tmp_path / "o")
    assert code == 2 and "--chat-template does nothing for the mean merge" in err and not (tmp_path / "o").exists()


def test_the_calibration_record_says_how_many_conversations_were_rendered_and_with_which_template(
        tiny_chat, tmp_path):
    import hashlib

    import surgery

    def calibrated(out, **kw):
        result = surgery.convert(tiny_chat, tmp_path / out, to="mqa", merge="aligned", calib_tokens=512, device="cpu",
                                 **kw)
        return result.record["calibration"]

    rows = [{"messages": [{"role": m["role"], "content": m["content"][:300]} for m in row["messages"]]}
            for row in conversations()]  # short ones: several fill the calibration tokens
    chat_jsonl = tmp_path / "short.jsonl"
    chat_jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tok = tf.AutoTokenizer.from_pretrained(tiny_chat)
    rendered = [tok.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    on = calibrated("on", calib=str(chat_jsonl))
    n = on["chat"]["conversations"]
    assert on["chat"] == {"conversations": n, "rendered": "chat template", "chat_template": "auto",
                          "template_sha256": hashlib.sha256(TEMPLATE.encode()).hexdigest()}
    # the conversations counted are the documents read: each one's sha256 is that of its rendering
    assert 1 < n < len(rendered) and on["documents_sha256"] == [hashlib.sha256(t.encode()).hexdigest()
                                                               for t in rendered[:n]]
    off = calibrated("off", calib=str(chat_jsonl), chat_template="off")
    assert off["chat"] == {"conversations": len(off["documents_sha256"]), "rendered": "contents joined",
                           "chat_template": "off"}
    mixed = calibrated("mixed", calib=("pydoc", str(chat_jsonl)))  # only the chat half has conversations
    assert 0 < mixed["chat"]["conversations"] < n and mixed["chat"]["rendered"] == "chat template"
    assert "chat" not in calibrated("plain", calib="pydoc")


def test_a_conversation_without_a_template_masks_its_assistant_contents():
    """Without a chat template the turns are joined; --loss-on assistant counted the user's turns too (exit 0)."""
    from surgery.chat import ChatText

    messages = [{"role": "user", "content": "Explain x"}, {"role": "assistant", "content": "x is y."},
                {"role": "user", "content": "And z?"}, {"role": "assistant", "content": "z too."}]
    text = ChatFormat("off", None, spans=True).render(messages, "rows")
    assert isinstance(text, ChatText) and text == "Explain x\n\nx is y.\n\nAnd z?\n\nz too."
    assert [text[a:b] for a, b in text.assistant_spans] == ["x is y.", "z too."]
    with pytest.raises(SurgeryError, match="has the role 'wizard'"):
        ChatFormat("off", None).render([{"role": "wizard", "content": "hi"}], "rows")


@pytest.mark.parametrize("rows, fragment", [
    ([{"text": "plain prose " * 40}] * 20, "the data holds no conversation"),
    ([{"messages": [{"role": "user", "content": "only a question " * 20}]}] * 20, "has an assistant turn"),
])
def test_loss_on_assistant_with_nothing_to_train_on_is_refused_before_any_step(tiny_chat, tmp_path, rows, fragment):
    """Both trained on every token (plain text) or failed at step 1 leaving a run folder; now refused in setup."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SurgeryError, match=fragment):
        uptrain(UptrainOptions(model=str(tiny_chat), out=tmp_path / "o", **(FAST | dict(
            loss="lm", tokens=512, data=[str(data)], data_mode="packed", loss_on="assistant"))))
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()
