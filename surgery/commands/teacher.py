"""`surgery teacher` once its options are validated: one stored teacher pass over a run's training windows
(surgery/training/teacher_pass.py). Its data options are uptrain's own (UptrainArgs), so that the same words give
the same windows."""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator

from ..options import CliModel, at_least_one, option
from ..training.options import UptrainArgs

# uptrain's options that fix the training windows, and the teacher's run (its precision, temperature, batch, output)
TEACHER_OPTIONS = ("data", "data_weights", "data_mode", "data_workers", "data_epochs", "tokens", "skip_tokens",
                   "text_field", "txt_unit", "streaming", "chat_template", "retrieval_mix", "retrieval_questions",
                   "seq_len", "batch_tokens", "micro_batch", "eval_tokens", "seed", "temperature", "trust_teacher_code",
                   "precision", "force")

# those that fix the windows and their order (the store's windows spec, surgery/training/teacher_store.py) and the
# temperature it holds the teacher at: a store serves only runs with the same values (a recipe's teacher step takes
# them from the uptrain steps that read its store)
WINDOW_OPTIONS = tuple(n for n in TEACHER_OPTIONS if n not in ("micro_batch", "trust_teacher_code", "precision", "force"))

__all__ = ["TEACHER_OPTIONS", "WINDOW_OPTIONS", "TeacherArgs", "UptrainArgs", "store_teacher_pass"]


class TeacherArgs(CliModel):
    """`surgery teacher`'s own options (beside uptrain's data options): what it stores and where it runs."""

    top_k: int = option(32, "--top-k", "Teacher candidates stored per position.")
    device: str = option("auto", "--device", "auto (CUDA when present), cpu, cuda, cuda:N.")
    processes: int = option(1, "--processes", "The number of processes of the uptrain run the store is for (streamed "
                            "data: each process streams its own windows, so the store takes them in that order; "
                            "packed data has one order for any number).")

    _at_least_one = field_validator("top_k", "processes")(at_least_one)


def store_teacher_pass(source: str, out: Path, options: UptrainArgs, top_k: int, device: str = "auto",
                       progress: bool = True, revision: str | None = None, processes: int = 1) -> dict:
    """Run the teacher `source` (at hub `revision`) over the windows `options` give a run and store its top-`top_k`;
    the manifest."""
    from ..training.options import UptrainOptions
    from ..training.teacher_pass import teacher_pass

    from ..checkpoint.atomic import output_parents

    run = UptrainOptions(model=source, out=Path(out), **options.model_dump())
    with output_parents(out):
        return teacher_pass(source, Path(out), run, top_k, device=device, trust_teacher_code=options.trust_teacher_code,
                            progress=progress, revision=revision, processes=processes)
