"""Experiment trackers (`--report-to`): accelerate's trackers (TensorBoard, Weights & Biases, trackio, MLflow) get
the run's configuration when it starts and every metrics line the run writes to its metrics.jsonl (which stays).

TensorBoard writes into the run folder (`RUN_DIR/runs/uptrain`) and the output keeps a copy (`OUT/runs`), where the
hub's training-metrics tab finds it; the others write where their own settings say (WANDB_DIR / WANDB_MODE,
MLFLOW_TRACKING_URI, trackio's cache)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from ..errors import SurgeryError

# --report-to NAME -> (the module it imports, the pip package that provides it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "trackio": ("trackio", "trackio"), "mlflow": ("mlflow", "mlflow")}
REPORT_TO = ("none", *TRACKERS)
PROJECT = "uptrain"  # accelerate's project (run) name: W&B's and trackio's project, TensorBoard's subfolder
TB_DIR = "runs"  # TensorBoard's folder in the run folder and in the output (where the hub looks for event files)


def parse_report_to(value: str | list[str] | None, flag: str = "--report-to") -> list[str]:
    """--report-to as tracker names: a comma-separated list (or a recipe's list), `none` for no tracker."""
    names = value if isinstance(value, list) else str(value or "none").split(",")
    names = [str(n).strip().lower() for n in names if str(n).strip()]
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown:
        raise SurgeryError(f"unknown {flag} {unknown[0]!r}; choose from {', '.join(REPORT_TO)} (comma-separated)")
    if "none" in names and len(names) > 1:
        raise SurgeryError(f"{flag} none cannot be combined with a tracker")
    return [n for n in dict.fromkeys(names) if n != "none"]


def require_trackers(names: list[str], flag: str = "--report-to") -> None:
    """Each tracker's package importable, else one line naming the package to install."""
    for name in names:
        module, package = TRACKERS[name]
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin in (None, "namespace"):  # (a bare folder of that name: no package)
            where = (f" (a folder {module} on the import path is not it: {list(spec.submodule_search_locations)[0]})"
                     if spec is not None and spec.submodule_search_locations else "")
            raise SurgeryError(f"{flag} {name} needs the {package} package: pip install {package}{where}")


def flat_config(values: dict) -> dict:
    """The run's configuration as trackers take it: one level, values str/int/float/bool (TensorBoard's hparams
    take nothing else); lists and dicts flattened into dotted keys, paths and None as text."""
    out: dict = {}

    def put(key: str, v) -> None:
        if isinstance(v, dict):
            for k, item in v.items():
                put(f"{key}.{k}", item)
        elif isinstance(v, (list, tuple)):
            out[key] = ",".join(str(item) for item in v)
        elif isinstance(v, bool) or isinstance(v, (int, str)):
            out[key] = v
        elif isinstance(v, float):
            out[key] = v if math.isfinite(v) else str(v)
        else:
            out[key] = str(v)

    for k, v in values.items():
        put(k, v)
    return out


def tracker_values(fields: dict) -> tuple[dict, int | None]:
    """One metrics line as a tracker's values and step: the numbers but the step (non-finite ones left out)."""
    step = fields.get("step")
    values = {k: v for k, v in fields.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
              and math.isfinite(v)}
    return values, step


def start_trackers(acc, names: list[str], config: dict) -> None:
    """accelerate's trackers started with the run's configuration (main process; a no-op without trackers)."""
    if not names:
        return
    try:
        acc.init_trackers(PROJECT, config=flat_config(config))
    except Exception as e:  # a tracker that cannot start (W&B without a login or WANDB_MODE=offline, MLflow's URI)
        why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise SurgeryError(f"--report-to {','.join(names)}: the tracker cannot start ({why[:200]})") from None


def finish_trackers(acc) -> None:
    """Close the trackers (flushing TensorBoard's event file before the output copies it); accelerate's
    end_training then finds none left to close."""
    for tracker in list(getattr(acc, "trackers", [])):
        tracker.finish()
    if getattr(acc, "trackers", None):
        acc.trackers = []


def copy_tensorboard(run_dir: Path, out: Path) -> None:
    """The run's TensorBoard event files into the output (`OUT/runs`), as transformers' Trainer leaves them."""
    import shutil

    logs = Path(run_dir) / TB_DIR
    if logs.is_dir():
        shutil.copytree(logs, Path(out) / TB_DIR)
