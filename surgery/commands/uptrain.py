"""`surgery uptrain` once its options are validated: continue training a model (surgery/training). The options
model, its rules and the fields a recipe's runner sets are surgery/training/options.py's."""

from __future__ import annotations

from pathlib import Path

from ..training.options import RUNNER_OWNED, UptrainArgs

__all__ = ["RUNNER_OWNED", "UptrainArgs", "uptrain_dry_run", "uptrain_model"]


def uptrain_model(model: str, out: Path, options: UptrainArgs, progress: bool = True) -> dict:
    """Train; returns the uptraining record written into OUT/surgery.json (`progress`: the progress display)."""
    from ..checkpoint.atomic import output_parents
    from ..training import UptrainOptions, uptrain

    with output_parents(out):  # missing folders above OUT (and OUT.run) made, removed again if left empty
        return uptrain(UptrainOptions(model=model, out=Path(out), progress=progress, **options.model_dump()))


def uptrain_dry_run(model: str, options: UptrainArgs) -> list[str]:
    """The memory of each process `surgery uptrain MODEL ... --dry-run` prints (surgery/memory_estimate.py): as many
    processes as `accelerate launch` started (WORLD_SIZE; FSDP when several), on CUDA when this machine has it,
    with the teacher when the loss distills. Nothing is loaded beyond the checkpoints' headers and configs."""
    import os

    import torch

    from ..checkpoint.record import local_source_folder, read_record
    from ..checkpoint.source import resolve_source
    from ..memory_estimate import stats_from_folder, uptrain_memory_per_process
    from ..training.model_io import teacher_source

    source = resolve_source(model)
    record = read_record(source.folder)
    teacher_known = bool(options.teacher or (record.get("source") or {}).get("spec") or local_source_folder(record))
    distill = options.loss in ("kd", "mix") or (options.loss == "auto" and teacher_known) or options.hidden_weight > 0
    teacher = teacher_source(record, options.teacher) if distill and not options.teacher_logprobs else None
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    device = "cuda" if torch.cuda.is_available() and not cpu else "cpu"
    stats = stats_from_folder(source.folder)
    estimate = uptrain_memory_per_process(stats, options, stats_from_folder(teacher.folder) if teacher else None,
                                          processes, device=device)
    store = [] if not options.teacher_logprobs else stored_teacher_lines(options)
    return [f"{source.spec}: {stats.params:,} parameters" + (f", teacher {teacher.spec}" if teacher else ""),
            *estimate.lines(), *store]


def stored_teacher_lines(options: UptrainArgs) -> list[str]:
    """--teacher-logprobs in the dry run: the store's size for this run's tokens (from its manifest, or what `surgery
    teacher` at the default --top-k would write when it is not made yet), and that no teacher is loaded."""
    from ..training.teacher_store import MANIFEST, bytes_per_token, human_bytes, read_manifest

    folder = Path(options.teacher_logprobs)
    tokens = -(-options.tokens // options.batch_tokens) * options.batch_tokens
    if (folder / MANIFEST).is_file():
        m = read_manifest(folder)
        k, held = m["top_k"], f"; it holds {m['tokens']:,} tokens ({human_bytes(m['bytes_per_token'] * m['tokens'])})"
    else:
        k, held = 32, f"; {folder} is not made yet (`surgery teacher --top-k 32` would write it)"
    per = bytes_per_token(k)
    step = options.batch_tokens * per
    return [f"teacher: stored top-{k} ({per} B/token: fp16 log-probs and int32 ids per candidate, an fp16 tail), "
            f"{human_bytes(per * tokens)} for this run's {tokens:,} tokens{held}",
            f"teacher: none in memory (host or GPU); each step reads {human_bytes(step)} of the store"]
