"""Complete llama.cpp's GGUF of an MLA output so that llama.cpp loads it (`python -m surgery.mla.gguf FILE.gguf`).

llama.cpp's own converter (`convert_hf_to_gguf.py`) writes `deepseek2.attention.q_lora_rank` only when the
checkpoint has a query LoRA, and llama.cpp's loader (up to at least the llama.cpp that llama-cpp-python 0.3.36
vendors) requires that key unless the model has 26, 27 or 48 layers — its test for DeepSeek-V2-Lite-like models.
Our outputs have no query LoRA (`q_lora_rank: null`, plain `q_proj`), so llama.cpp refuses them with "key not found
in model: deepseek2.attention.q_lora_rank". Adding the key with 0 (no query LoRA: llama.cpp then builds `wq`, the
plain query projection, which is what the converter wrote) is all it needs; tensors and other keys are copied as
they are, with the `gguf` package's own copier, into a temporary file renamed over the original when complete.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from ..errors import SurgeryError

Q_LORA_RANK = "deepseek2.attention.q_lora_rank"


def complete_for_llama_cpp(path: Path) -> bool:
    """Add `deepseek2.attention.q_lora_rank = 0` to the GGUF at `path` when it is missing; True when it was added.

    A symlink is followed (its target is completed, the link stays a link; a loop is refused); a read-only file or a
    file in a read-only folder is refused in one line and left as it is; the completed file keeps the original's
    mode. Any parse error of a broken file is one line."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    from ..checkpoint.validate import regular_file

    given = Path(path)
    try:
        path = given.resolve(strict=True)  # the link's target, once: it is the file that is rewritten
    except (OSError, RuntimeError) as e:
        reason = "a symlink loop" if isinstance(e, RuntimeError) or e.errno == 40 else e.strerror
        raise SurgeryError(f"{given}: cannot open ({reason})") from None
    regular_file(path, "GGUF file")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    try:
        reader = gguf.GGUFReader(path, "r")
        arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
        arch = arch_field.contents() if arch_field else None
        complete = reader.get_field(Q_LORA_RANK) is not None
    except Exception as e:  # noqa: BLE001 - a truncated or forged file raises IndexError, ValueError, struct errors
        raise SurgeryError(f"{given}: not a readable GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if arch != "deepseek2":
        raise SurgeryError(f"{given}: a {arch or 'unknown'} GGUF; only DeepSeek-V2/V3 (deepseek2) files need this")
    if complete:
        return False
    if not mode & 0o222 or not os.access(path, os.W_OK):
        raise SurgeryError(f"{given}: the file is read-only (its mode or its file system); nothing was changed")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise SurgeryError(f"{given}: its folder {path.parent} is read-only; the completed file is written beside it")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
        alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
        if alignment is not None:
            writer.data_alignment = alignment.contents()
        copy_with_new_metadata(reader, writer, {Q_LORA_RANK: MetadataDetails(gguf.GGUFValueType.UINT32, 0)}, [])
        del reader
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:  # a read-only mount, a full disk
        raise SurgeryError(f"{given}: cannot write the completed file beside it ({e.strerror or e}); left as it was") from None
    finally:
        tmp.unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m surgery.mla.gguf FILE`, a command of its own (no logging set up): its result and errors printed."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m surgery.mla.gguf FILE.gguf", file=sys.stderr)
        return 2
    try:
        added = complete_for_llama_cpp(Path(args[0]))
    except SurgeryError as e:
        print(f"surgery: error: {e}", file=sys.stderr)
        return 2
    print(f"{args[0]}: {'added ' + Q_LORA_RANK + ' = 0' if added else 'already complete'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
