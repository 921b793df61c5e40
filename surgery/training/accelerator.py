"""The run's accelerate `Accelerator`: the compute precision (autocast), DDP or FSDP (FSDP2 only, on CPU too), and
how the models are read under it (rank 0 alone under FSDP, the teacher sharded like the student, in what dtype)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SurgeryError
from ..precision import resolve_precision
from .options import UptrainOptions


def make_accelerator(precision: str = "auto", log_with: list[str] | None = None, project_dir: Path | None = None):
    """Autocast in `--precision` (surgery/precision.py; auto: bf16 on CUDA with bf16, fp32 elsewhere; bf16 on the CPU
    is torch's CPU autocast, the same code path as on CUDA). Without CUDA, cpu=True lets several processes started by
    `accelerate launch --multi_gpu --num_processes N` (torchrun) or `torchrun` run DDP on CPU over gloo, and
    an FSDP config (`accelerate launch --config_file fsdp.yaml`) run FSDP on CPU over gloo (see `use_fsdp_on_cpu`);
    under FSDP, `use_fsdp2` sets the mixed precision policy. `log_with`: the experiment trackers (--report-to),
    `project_dir`: where TensorBoard writes (surgery/training/trackers.py)."""
    import os

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")
    resolved = resolve_precision(precision, "cuda" if cuda else "cpu")
    mixed = "bf16" if resolved == "bf16" else "no"
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state.get("_mixed_precision", mixed) != mixed:
        # an earlier run in this process (the library, tests) left another precision in accelerate's shared state,
        # which refuses a change: start it afresh (the process group, PartialState's, stays)
        AcceleratorState._reset_state(reset_partial_state=False)
    acc = Accelerator(cpu=not cuda, mixed_precision=mixed, log_with=log_with or None,
                      project_dir=str(project_dir) if project_dir is not None else None)
    fsdp_config = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"  # set by accelerate launch
    if fsdp_config and acc.distributed_type == DistributedType.MULTI_CPU:
        use_fsdp_on_cpu(acc)
    if acc.distributed_type == DistributedType.FSDP:
        use_fsdp2(acc)
    return acc


def precision_of(acc) -> str:
    """The compute precision an Accelerator runs in: "bf16" (autocast) or "fp32"."""
    return "bf16" if str(acc.mixed_precision) == "bf16" else "fp32"


def use_fsdp_on_cpu(acc) -> None:
    """accelerate (1.15) selects FSDP only with an accelerator device: on CPU it silently runs DDP instead, every
    process holding the whole model. torch's FSDP runs on CPU over gloo, so select it from the launch config
    (FSDP_* variables) the way accelerate does on GPUs: the distributed type lives in state shared by
    PartialState and AcceleratorState."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()


def use_fsdp2(acc) -> None:
    """FSDP is FSDP2 (`fully_shard`) or refused: FSDP1 casts buffers to its bf16 buffer dtype (RoPE's inv_freq: a
    phase error of ~7 rad at position 4096 at Llama-3's base) and clips a partly trained model's gradients by each
    shard's local norm. With bf16 the policy is bf16 compute and fp32 gradient reduction (accelerate builds bf16 for
    both from `mixed_precision: bf16`, and a config file cannot say reduce_dtype); FSDP2 casts parameters only, so
    buffers keep the dtype they were built in."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = acc.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise SurgeryError(f"uptrain runs FSDP2 only (the accelerate config asks for FSDP{plugin.fsdp_version}, which "
                           "casts RoPE's inv_freq to bf16): set fsdp_version: 2 under fsdp_config, as "
                           "recipes/accelerate/fsdp-8gpu.yaml does")
    if acc.mixed_precision == "bf16":
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif acc.mixed_precision == "no":
        plugin.mixed_precision_policy = None


def shard_teacher(teacher, acc):
    """Under FSDP the frozen teacher is sharded like the student, by accelerate's own FSDP2 preparation (one unit per
    decoder layer, the embeddings, the head; the run's mixed precision policy; with rank-0 loading, the weights
    broadcast from rank 0): each process holds 1/N of its weights and gathers one layer at a time in its forward, so a
    teacher as large as the student, or larger, fits beside it. Each unit is moved to the device as it is sharded: the
    whole teacher never lands on a GPU. No gradients, no optimizer state; the teacher is not one of accelerate's
    models (its checkpoints hold the student alone)."""
    import copy

    from accelerate.utils import fsdp2_prepare_model

    plugin = acc.state.fsdp_plugin
    acc.state.fsdp_plugin = copy.copy(plugin)  # preparing sets the plugin's layer classes: the student's must be its own
    try:
        return fsdp2_prepare_model(acc, teacher)
    finally:
        acc.state.fsdp_plugin = plugin


def rank_zero_loads(acc, o: UptrainOptions, kind) -> bool:
    """Under FSDP, rank 0 alone reads the student and the teacher; the other ranks build them without weights and
    receive their shards in `prepare` (accelerate's cpu_ram_efficient_loading). Not with the align stage (it trains
    whole models on every rank before sharding) nor for a kind with a training form (it rewrites the loaded weights and
    module settings on every rank)."""
    from accelerate.utils import DistributedType

    from ..kinds.base import Kind

    return (acc.distributed_type == DistributedType.FSDP and "align" not in o.stages
            and (kind is None or type(kind).training_form is Kind.training_form))


def teacher_dtype(acc, o: UptrainOptions) -> torch.dtype:
    """The frozen teacher needs no fp32 master copy: loaded in the compute precision (bf16 in a bf16 run), except for
    the align stage, which trains the student's fp32 layers on its hidden states."""
    return torch.bfloat16 if acc.mixed_precision == "bf16" and "align" not in o.stages else torch.float32
