"""The setup of one `surgery uptrain` run under `accelerate launch` (the same make_accelerator, model loading, teacher
sharding and `prepare` as the command), reported by every rank as OUT/rank-N.json: the dtype of each buffer of the
student and the teacher, the parameters that differ from the checkpoint's (none should: rank 1 receives its shards
from rank 0), which of them this rank read from the checkpoint, whether each rotary embedding's cos/sin tables (positions 0..4095) equal those of the model
loaded alone, the FSDP2 mixed precision policy of the student's root unit, and the process's peak RSS.

    accelerate launch --config_file CFG -m surgery.testing.fsdp_probe OUT MIXED_PRECISION MODEL [TEACHER] [--every-rank-reads]

--every-rank-reads: the loading before rank-0 loading, for a baseline (every rank reads the student and the
teacher, the teacher in fp32).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

POSITIONS = 4096


def rotary_tables(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each rotary embedding's (cos, sin) for positions 0..POSITIONS-1, computed in fp32 on the CPU from a copy of the
    module (its inv_freq as prepared): a model prepared on CUDA and one loaded alone on the host then differ only if
    the buffers do (CUDA's cos/sin round differently from the CPU's in the last bits, which the H100 run showed)."""
    import copy

    tables = {}
    positions = torch.arange(POSITIONS)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            cos, sin = copy.deepcopy(module).to("cpu")(x, positions)
            tables[name] = (cos, sin)
    return tables


def report(model, reference) -> dict:
    """`model`'s buffers' dtypes and whether its rotary tables equal `reference`'s (the same checkpoint, loaded alone)."""
    ours, theirs = rotary_tables(model), rotary_tables(reference)
    loaded = dict(reference.named_parameters())
    differ = []
    for name, p in model.named_parameters():  # every rank gathers every parameter (a collective), in the same order
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        if not torch.equal(whole.detach().cpu(), loaded[name].detach().to(p.dtype)):
            differ.append(name)
    return {"weights_differ": differ,
            "buffers": {name: str(b.dtype).removeprefix("torch.") for name, b in model.named_buffers()},
            "rotary_exact": {name: bool(torch.equal(ours[name][0], theirs[name][0])
                                        and torch.equal(ours[name][1], theirs[name][1])) for name in theirs},
            "rotary_max_abs_diff": {name: max(float((ours[name][i] - theirs[name][i]).abs().max()) for i in (0, 1))
                                    for name in theirs},
            "rotary_modules": sorted(ours)}


def mp_policy(model) -> dict | None:
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    if state is None:
        return None
    policy = state._mp_policy
    return {k: str(getattr(policy, k)).removeprefix("torch.") for k in ("param_dtype", "reduce_dtype")}


def main(argv: list[str]) -> None:
    from ..checkpoint.source import resolve_source
    from ..training import loop, model_io, recipe_setup
    from ..training.model_io import load_causal_lm
    from ..training.options import UptrainOptions
    from .pydoc_llama import FAST

    every_rank_reads = "--every-rank-reads" in argv
    argv = [a for a in argv if a != "--every-rank-reads"]
    out, precision, model = Path(argv[0]), argv[1], argv[2]
    teacher = argv[3] if len(argv) > 3 else None
    reads: dict[str, bool] = {}  # role -> whether this rank read the checkpoint's weights
    load = model_io.load_causal_lm

    def recording_load(source, role, *args, **kw):
        reads[role] = kw.get("weights", True)
        return load(source, role, *args, **kw)

    model_io.load_causal_lm = recording_load
    if every_rank_reads:
        recipe_setup.rank_zero_loads = lambda acc, o, kind: False
        recipe_setup.teacher_dtype = lambda acc, o: torch.float32
    args = dict(FAST, tokens=FAST["batch_tokens"], eval_tokens=512, loss="kd" if teacher else "lm", teacher=teacher,
                precision={"no": "fp32"}.get(precision, precision))
    recipe = loop.setup(UptrainOptions(model=model, out=out / "run-output", force=True, **args))
    peak_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # loading and prepare, before the references
    model_io.load_causal_lm = load
    acc, models = recipe.run.acc, recipe.models
    result = {"rank": acc.process_index, "world": acc.num_processes, "distributed_type": acc.distributed_type.value,
              "mixed_precision": acc.mixed_precision, "peak_rss_kib": peak_rss_kib, "policy": mp_policy(models.model),
              "read_weights": reads,
              "student": report(acc.unwrap_model(models.model), load_causal_lm(resolve_source(model), "model"))}
    if teacher:
        result["teacher"] = report(models.teacher, load_causal_lm(resolve_source(teacher), "teacher"))
        result["teacher_param_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in models.teacher.parameters()})
    (out / f"rank-{acc.process_index}.json").write_text(json.dumps(result, indent=2) + "\n")
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
