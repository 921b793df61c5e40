"""Chat data: a `messages` column (a list of {role, content}) in tabular data (.jsonl/.json/.parquet/.csv, hub
datasets) is rendered with the tokenizer's chat template (`--chat-template on|off|auto`; auto: on when the source has
a messages column and the tokenizer has a template). Off, or without a template under auto, a conversation is its
contents joined by blank lines (a source with a --text-field column reads that column instead).

The rendered conversation is one document: tokenized as any text is (the template's special tokens, such as
`<|im_start|>`, are the tokenizer's added tokens and tokenize to themselves), joined to the next by EOS.

Assistant turns (uptrain `--loss-on assistant`): a rendered conversation is a `ChatText`, a str that also carries the
character spans of its assistant turns. They are found by rendering prefixes of the conversation, not through
`apply_chat_template(return_assistant_tokens_mask=True)`, which needs a template written with `{% generation %}`
blocks (SmolLM2's and most shipped templates have none): an assistant turn `i` spans from the end of the rendering
of turns `< i` with the generation prompt to the end of the rendering of turns `<= i` (its content and its
end-of-turn marker, which teaches the model to stop). A template whose renderings of prefixes are not prefixes of
the whole (one that moves text around depending on later turns) is refused in one line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import SurgeryError

CHAT_MODES = ("auto", "on", "off")
MESSAGES = "messages"  # the column a conversation is read from
ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")  # roles chat templates know


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_sha256(tokenizer) -> str | None:
    """The sha256 of the tokenizer's chat template (its text; several named templates: their JSON), None without."""
    import hashlib
    import json

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_messages(messages: Any, label: str) -> list[dict]:
    """A conversation as a list of {"role": str, "content": str}, or one line saying what the row holds instead."""
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise SurgeryError(f"data {label}: a {MESSAGES!r} row must be a non-empty list of {{role, content}} texts, "
                           f"got {str(messages)[:80]!r}")
    unknown = sorted({m["role"] for m in messages} - set(ROLES))
    if unknown:
        raise SurgeryError(f"data {label}: a conversation has the role {unknown[0]!r}; roles are "
                           f"{', '.join(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def plain_conversation(messages: list[dict], spans: bool) -> str:
    """A conversation without a chat template: its turns' contents, one paragraph each; with `spans`, a ChatText
    whose spans are the assistant turns' contents (--loss-on assistant counts them, not the other turns)."""
    text = "\n\n".join(m["content"] for m in messages)
    if not spans:
        return text
    out, found, at = ChatText(text), [], 0
    for m in messages:
        if m["role"] == "assistant":
            found.append((at, at + len(m["content"])))
        at += len(m["content"]) + 2
    out.assistant_spans = tuple(found)
    return out


class ChatText(str):
    """A rendered conversation: the text, and `assistant_spans`, the [start, end) character ranges of its assistant
    turns."""

    assistant_spans: tuple[tuple[int, int], ...] = ()


def assistant_spans(render, messages: list[dict], text: str, label: str) -> tuple[tuple[int, int], ...]:
    """The character spans of the assistant turns of `text` = render(messages), by rendering prefixes."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = render(messages[:i], True) if i else render([], True)
        end = render(messages[: i + 1], False)
        if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
            raise SurgeryError(f"data {label}: --loss-on assistant needs a chat template that renders a conversation "
                               "turn by turn (its renderings of the first turns are not the start of the whole); use "
                               "--loss-on all")
        spans.append((len(start), len(end)))
    return tuple(spans)


def token_mask(tokenizer, text: str, spans) -> tuple[list[int], list[int]]:
    """`text`'s token ids and, per token, 1 when it lies in one of the character `spans` (a fast tokenizer's
    offsets), else 0."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= s < b for a, b in spans)) if e > s else 0 for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask


@dataclass(frozen=True)
class ChatFormat:
    """How conversations become text: `mode` (--chat-template) and the tokenizer whose template renders them."""

    mode: str = "auto"
    tokenizer: Any = None
    spans: bool = False  # keep the assistant turns' character spans (ChatText), for --loss-on assistant
    read: dict = field(default_factory=dict, compare=False, repr=False)  # {"conversations": n} rendered so far

    def __post_init__(self):
        if self.mode not in CHAT_MODES:
            raise SurgeryError(f"unknown --chat-template {self.mode!r}; choose from {', '.join(CHAT_MODES)}")
        if self.mode == "on" and not has_template(self.tokenizer):
            raise SurgeryError("--chat-template on: the tokenizer has no chat template (chat_template in "
                               "tokenizer_config.json or chat_template.jinja)")

    @property
    def templated(self) -> bool:
        """Whether conversations are rendered with the template (on; auto with a template)."""
        return self.mode != "off" and has_template(self.tokenizer)

    def reads_messages(self, columns: list[str], text_field: str) -> bool:
        """Whether a source with these columns is read from its messages column: rendered with the template when
        there is one to use, else plainly when it has no --text-field column."""
        if MESSAGES not in columns:
            return False
        return self.templated or text_field not in columns

    def render(self, messages: Any, label: str) -> str:
        messages = check_messages(messages, label)
        self.read["conversations"] = self.read.get("conversations", 0) + 1  # (the dict is mutable, the format not)
        if not self.templated:
            return plain_conversation(messages, self.spans)
        def render(part: list[dict], prompt: bool) -> str:
            return self.tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)
        try:
            text = render(messages, False)
            if not self.spans:
                return text
            out = ChatText(text)
            out.assistant_spans = assistant_spans(render, messages, text, label)
            return out
        except SurgeryError:
            raise
        except Exception as e:  # a template that raises on this conversation (jinja's errors, roles it refuses)
            raise SurgeryError(f"data {label}: the chat template cannot render a conversation "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def chat_record(chat: ChatFormat | None) -> dict | None:
    """What a record (surgery.json's "calibration") says about the conversations `chat` rendered: how many, how
    (the chat template, whose sha256 names it, or their contents joined) and the --chat-template asked for; None
    when no conversation was read."""
    count = chat.read.get("conversations", 0) if chat is not None else 0
    if not count:
        return None
    record = {"conversations": count, "rendered": "chat template" if chat.templated else "contents joined",
              "chat_template": chat.mode}
    if chat.templated:
        record["template_sha256"] = template_sha256(chat.tokenizer)
    return record


def describe(chat: ChatFormat | None) -> str | None:
    """The record's note on how conversations were read (None: no chat format given)."""
    if chat is None:
        return None
    return "chat template" if chat.templated else "contents joined"
