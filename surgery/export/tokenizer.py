"""The checkpoint's tokenizer (tokenizer.json) as GGUF metadata: a byte-level BPE vocabulary as llama.cpp's `gpt2`
tokenizer model, with its tokens in id order (ids the model has and the tokenizer lacks as unused `[PADn]`),
token types (added special tokens CONTROL, other added tokens USER_DEFINED), merges, special-token ids and chat
template (gguf-py's SpecialVocab reads those), and the name of llama.cpp's pre-tokenizer that splits the text as
tokenizer.json's pre_tokenizer does. A tokenizer whose splitting llama.cpp would not reproduce is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..errors import SurgeryError

NORMAL, USER_DEFINED, CONTROL, UNUSED = 1, 4, 3, 5  # gguf.TokenType


def _byte_level(p: Any) -> bool:
    return isinstance(p, dict) and p.get("type") == "ByteLevel" and p.get("use_regex", True) \
        and not p.get("add_prefix_space", False)


def pre_tokenizer_name(pre: Any) -> str | None:
    """llama.cpp's name for the pre-tokenizer `pre` (tokenizer.json's pre_tokenizer), or None when it has none:
    GPT-2's byte-level regex alone is `gpt-2`; single digits split first, then GPT-2's regex, is `smollm`."""
    if _byte_level(pre):
        return "gpt-2"
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        if len(parts) == 2 and parts[0].get("type") == "Digits" and parts[0].get("individual_digits") \
                and _byte_level(parts[1]):
            return "smollm"
    return None


def read_tokenizer(folder: Path, vocab_size: int) -> tuple[list[str], list[int], str]:
    """(tokens in id order, their types, the pre-tokenizer's name) of `folder`'s tokenizer.json; refuses one that
    llama.cpp's gpt2 tokenizer would not reproduce."""
    from ..checkpoint import validate

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise SurgeryError(f"{folder} has no tokenizer.json: the GGUF file needs the vocabulary")
    validate.regular_file(path, "tokenizer")
    try:
        tok = json.loads(path.read_text())
        model = tok["model"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise SurgeryError(f"cannot read {path}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise SurgeryError(f"{path}: a {model.get('type') if isinstance(model, dict) else '?'} tokenizer; the "
                           f"exporter writes byte-level BPE tokenizers only")
    if tok.get("normalizer") is not None:
        raise SurgeryError(f"{path}: the tokenizer normalizes its text ({tok['normalizer'].get('type')}), which the "
                           f"exported gpt2 tokenizer would not do")
    pre = pre_tokenizer_name(tok.get("pre_tokenizer"))
    if pre is None:
        kind = (tok.get("pre_tokenizer") or {}).get("type", "none")
        raise SurgeryError(f"{path}: pre-tokenizer {kind} is not one whose llama.cpp name the exporter knows "
                           f"(byte-level GPT-2, or single digits then byte-level)")
    by_id: dict[int, str] = {}
    for token, i in model["vocab"].items():
        by_id[int(i)] = token
    types: dict[int, int] = {}
    for added in tok.get("added_tokens") or []:
        i = int(added["id"])
        by_id[i] = added["content"]
        types[i] = CONTROL if added.get("special") else USER_DEFINED
    if by_id and max(by_id) >= vocab_size:
        raise SurgeryError(f"{path}: token id {max(by_id)} is beyond the model's vocab_size {vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [UNUSED if i not in by_id else types.get(i, NORMAL) for i in range(vocab_size)]
    return tokens, token_types, pre


def tokenizer_writer(folder: Path, vocab_size: int) -> tuple[Callable[[Any], None], str]:
    """(a function that adds the tokenizer's keys to a GGUFWriter, a phrase naming it); refuses before writing."""
    import logging

    import gguf

    tokens, token_types, pre = read_tokenizer(folder, vocab_size)
    gguf_log = logging.getLogger("gguf.vocab")
    level = gguf_log.level
    gguf_log.setLevel(logging.ERROR)  # its "Adding N merges" lines are not the command's
    try:
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    finally:
        gguf_log.setLevel(level)
    if not special.merges:
        raise SurgeryError(f"{folder}/tokenizer.json has no merges: not a BPE tokenizer llama.cpp can run")

    def write(writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        special.add_to_gguf(writer, quiet=True)

    return write, f"gpt2 tokenizer ({pre} pre-tokenizer, {len(special.merges)} merges)"
