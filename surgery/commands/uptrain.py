"""`surgery uptrain` once its options are validated: continue training a model (surgery/uptrain). The options
model, its rules and the fields a recipe's runner sets are surgery/uptrain/options.py's."""

from __future__ import annotations

from pathlib import Path

from ..uptrain.options import RUNNER_OWNED, UptrainArgs

__all__ = ["RUNNER_OWNED", "UptrainArgs", "uptrain_model"]


def uptrain_model(model: str, out: Path, options: UptrainArgs) -> None:
    from ..uptrain import UptrainOptions, uptrain

    uptrain(UptrainOptions(model=model, out=Path(out), **options.model_dump()))
