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
import sys
from pathlib import Path

from ..errors import SurgeryError

Q_LORA_RANK = "deepseek2.attention.q_lora_rank"


def complete_for_llama_cpp(path: Path) -> bool:
    """Add `deepseek2.attention.q_lora_rank = 0` to the GGUF at `path` when it is missing; True when it was added."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except (OSError, ValueError) as e:
        raise SurgeryError(f"{path}: not a readable GGUF file ({e})") from None
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = arch_field.contents() if arch_field else None
    if arch != "deepseek2":
        raise SurgeryError(f"{path}: a {arch or 'unknown'} GGUF; only DeepSeek-V2/V3 (deepseek2) files need this")
    if reader.get_field(Q_LORA_RANK) is not None:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
        alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
        if alignment is not None:
            writer.data_alignment = alignment.contents()
        copy_with_new_metadata(reader, writer, {Q_LORA_RANK: MetadataDetails(gguf.GGUFValueType.UINT32, 0)}, [])
        del reader
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
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
