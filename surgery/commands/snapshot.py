"""`surgery snapshot RUN --step N|latest --out X` once its options are validated: one checkpoint an uptraining run
kept (`uptrain --save-every N --keep-run-dir`) written as a model folder like the run's output
(surgery/training/snapshot.py)."""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator

from ..options import CliModel, option
from ..training.options import UptrainArgs

RUNNER_OWNED = ()


class SnapshotOptions(CliModel):
    step: str = option("latest", "--step", "The checkpoint to write: its step number, or latest.", metavar="N|latest")
    force: bool = option(False, "--force", "Replace an existing output folder.")
    trust_remote_code: bool = option(False, "--trust-remote-code", "Run modeling code that the run's input model "
                                     "ships (not needed for this toolkit's own unmodified code).")
    max_shard_size: str = option(UptrainArgs.model_fields["max_shard_size"].default, "--max-shard-size",
                                 "Largest output shard.")

    @field_validator("step", mode="before")
    @classmethod
    def _step(cls, v):
        """A step number (0 and up) or `latest`."""
        text = str(v).strip() if isinstance(v, (int, str)) and not isinstance(v, bool) else None
        if text != "latest" and not (text or "").isdigit():
            raise ValueError(f"--step takes a step number or latest, not {v!r}")
        return text if text == "latest" else str(int(text))

    @field_validator("max_shard_size")
    @classmethod
    def _shard_size(cls, v):
        from ..errors import SurgeryError
        from ..training.options import check_shard_size

        try:
            check_shard_size(v)
        except SurgeryError as e:
            raise ValueError(str(e)) from None
        return v


def snapshot_step(run_dir: Path, out: Path, options: SnapshotOptions) -> str:
    """Write the chosen step of `run_dir` into `out`; returns the line that says what was written."""
    from ..checkpoint.atomic import output_parents
    from ..training.snapshot import write_snapshot

    step = options.step if options.step == "latest" else int(options.step)
    with output_parents(out):
        record = write_snapshot(Path(run_dir), step, Path(out), force=options.force,
                                trusted=options.trust_remote_code, max_shard_size=options.max_shard_size)
    snap = record["snapshot"]
    ppl = f", held-out perplexity {record['eval_ppl']:.3f}" if record.get("eval_ppl") is not None else ""
    where = "an intermediate checkpoint" if snap["intermediate"] else "the end of its schedule"
    return (f"wrote {out}: step {snap['step']} of {snap['schedule_steps']} of {run_dir} ({where}), "
            f"{record['tokens']:,} tokens{ppl}")
