"""`surgery export CHECKPOINT --gguf OUT.gguf`: check the dtype and the output path, resolve the checkpoint, plan its
GGUF file (surgery/export: refused in one line before anything is written when llama.cpp would not compute the same
function), and stream it into OUT."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import SurgeryError
from ..export.gguf_file import DTYPE_NAMES


def check_gguf_output(out: Path, force: bool) -> None:
    """OUT can be written: not a folder, its folder exists and is writable, not an existing file unless `force`."""
    from ..checkpoint.atomic import check_writable_parent

    out = Path(out)
    if out.is_dir():
        raise SurgeryError(f"--gguf {out} is a folder; give a file name")
    if (out.exists() or out.is_symlink()) and not force:
        raise SurgeryError(f"--gguf {out} already exists (use --force to replace it)")
    check_writable_parent(out, f"--gguf {out}")


def export_checkpoint(source: str, out: Path, dtype: str = "f32", force: bool = False,
                      allow_pickle: bool = False, revision: str | None = None) -> str:
    """Write `source` (a converted checkpoint or a source: a folder, a .gguf file, `smollm2`, a hub id) as the GGUF
    file `out` with its matrices as `dtype`; returns the line that says what was written."""
    from ..checkpoint.source import load_config, resolve_source
    from ..checkpoint.tensors import CheckpointReader
    from ..export.gguf_file import file_type, write_gguf
    from ..export.plan import make_plan, refuse_before_loading
    from ..export.tokenizer import tokenizer_writer

    if dtype not in DTYPE_NAMES:
        raise SurgeryError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    out = Path(out)
    check_gguf_output(out, force)
    src = resolve_source(source, revision=revision, allow_pickle=allow_pickle)
    config = load_config(src.folder)
    refuse_before_loading(config)
    with CheckpointReader(src.folder, allow_pickle=allow_pickle) as reader:
        plan = make_plan(src.folder, config, reader)
        tokenizer, tokenizer_what = tokenizer_writer(src.folder, config["vocab_size"])
        keys = plan.keys | {"general.name": Path(os.path.normpath(str(src.folder))).name if src.gguf_file is None
                else Path(src.gguf_file).stem, "general.file_type": int(file_type(dtype))}
        size = write_gguf(out, plan.arch, keys, plan.tensors, dtype, extra=tokenizer)
    return f"wrote {out}: {plan.what}; {dtype}; {tokenizer_what}; {size / 1e6:.1f} MB"
