"""Do the two checkpoints of a check read the same token ids the same way?

Two models with the same vocabulary size but different tokenizers would be compared on ids that mean different
things to them: every number would be noise. `check` compares the tokenizers' vocabularies, end-of-text ids and
their encodings of probe texts, and refuses to go on when they differ unless `--tokenizer source|converted` says
which one encodes the text for both models.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SurgeryError

PROBE = ("The quick brown fox jumps over the lazy dog. def f(x):\n    return x ** 2  # naïve café, 東京, 🙂\n"
         "\tIndented\r\nline; numbers 1234567890 and <tags> {braces} [brackets] 'quotes' \"double\".")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model")


def has_tokenizer(folder: Path) -> bool:
    return any((Path(folder) / name).exists() for name in TOKENIZER_FILES)


def difference(a, b, probes: list[str]) -> str | None:
    """Why tokenizers `a` and `b` would give different ids, or None when they agree."""
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    if vocab_a != vocab_b:
        ids_a, ids_b = {i: t for t, i in vocab_a.items()}, {i: t for t, i in vocab_b.items()}
        differing = sum(ids_a.get(i) != ids_b.get(i) for i in set(ids_a) | set(ids_b))
        return f"their vocabularies differ ({differing} of {max(len(ids_a), len(ids_b))} ids name different tokens)"
    if a.eos_token_id != b.eos_token_id:
        return f"their end-of-text ids differ ({a.eos_token_id} and {b.eos_token_id})"
    for text in [PROBE, *probes]:
        if a(text, add_special_tokens=False)["input_ids"] != b(text, add_special_tokens=False)["input_ids"]:
            return "they encode the same text into different ids"
    return None


def choose_tokenizer(source_tokenizer, converted_tokenizer, choice: str | None, probes: list[str]):
    """The tokenizer that encodes the evaluation text for both models, and a note saying which (or None)."""
    if choice not in (None, "source", "converted"):
        raise SurgeryError(f"--tokenizer {choice}: choose source or converted")
    if converted_tokenizer is None:
        if choice == "converted":
            raise SurgeryError("--tokenizer converted: the converted checkpoint has no tokenizer files")
        return source_tokenizer, None
    why = difference(source_tokenizer, converted_tokenizer, probes)
    if why is None:
        return source_tokenizer, None
    if choice is None:
        raise SurgeryError(f"the two checkpoints' tokenizers differ: {why}; pass --tokenizer source or "
                           "--tokenizer converted to say which one encodes the text for both models")
    return (source_tokenizer if choice == "source" else converted_tokenizer), f"tokenizers differ ({why}); using the {choice}'s"
