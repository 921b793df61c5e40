"""`surgery teacher` once its options are validated: one stored teacher pass over a run's training windows
(surgery/uptrain/teacher_pass.py). Its data options are uptrain's own (UptrainArgs), so that the same words give
the same windows."""

from __future__ import annotations

from pathlib import Path

from ..uptrain.options import UptrainArgs

# uptrain's options that fix the training windows, and the teacher's run (its precision, temperature, batch, output)
TEACHER_OPTIONS = ("data", "data_weights", "data_mode", "data_workers", "data_epochs", "tokens", "text_field",
                   "txt_unit", "streaming", "chat_template", "seq_len", "batch_tokens", "micro_batch", "eval_tokens",
                   "seed", "temperature", "trust_teacher_code", "precision", "force")

__all__ = ["TEACHER_OPTIONS", "UptrainArgs", "store_teacher_pass"]


def store_teacher_pass(source: str, out: Path, options: UptrainArgs, top_k: int, device: str = "auto",
                       progress: bool = True) -> dict:
    """Run the teacher `source` over the windows `options` give a run and store its top-`top_k`; the manifest."""
    from ..uptrain.options import UptrainOptions
    from ..uptrain.teacher_pass import teacher_pass

    run = UptrainOptions(model=source, out=Path(out), **options.model_dump())
    return teacher_pass(source, Path(out), run, top_k, device=device, trust_teacher_code=options.trust_teacher_code,
                        progress=progress)
