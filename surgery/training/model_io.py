"""Loading the student and its teacher, and writing the uptrained checkpoint beside its record."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..version import __version__
from .. import runtime
from ..runtime import context_length, is_causal_lm
from ..errors import SurgeryError
from ..checkpoint.source import Source, copy_side_files, inside_file, resolve_source
from ..checkpoint.record import LOCAL_KEY, local_source_folder, now, read_record, source_name
from ..trust import resolve_trust
from ..checkpoint.tensors import DTYPES



FLAGS = {"model": "--trust-remote-code", "teacher": "--trust-teacher-code"}  # the flag that trusts each role's code


def trust_for(source: Source, role: str, trusted: bool) -> bool:
    """`trust_remote_code` for the model or the teacher: its own flag, or the toolkit's own unmodified code."""
    return resolve_trust(source.folder, trusted, flag=FLAGS[role], what=f"the {role} {trust_name(source)}")


def trust_name(source: Source) -> str:
    """The folder whose code would run (what the user must read before trusting it), and the spec it came from
    when that differs (a record's source spec, a hub id)."""
    folder = str(source.folder)
    return folder if Path(source.spec).absolute() == Path(folder).absolute() else f"{folder} (from {source.spec})"


def load_causal_lm(source: Source, role: str, trusted: bool = False, dtype: torch.dtype = torch.float32,
                   weights: bool = True, device: torch.device | str | None = None):
    """A causal LM (fp32 unless `dtype`) from a local folder; code it ships runs only as `surgery.trust.resolve_trust`
    allows. `weights=False`: built from its config without reading a weight, its parameters uninitialised memory
    (`empty_parameters`) and its buffers (RoPE's inv_freq) computed as loading computes them: for a rank that receives
    its FSDP shards from rank 0. `device` (other than the CPU): the weights are read straight onto it, tensor by
    tensor, so the host never holds the whole model (the H100 run: a 1B KD run loaded on the host peaked at 17 GB)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    remote = trust_for(source, role, trusted)
    try:
        config = AutoConfig.from_pretrained(source.folder, trust_remote_code=remote)
        if not is_causal_lm(config) and not (remote and "AutoModelForCausalLM" in source.config.get("auto_map", {})):
            raise SurgeryError(f"the {role} {source.spec} is not a causal LM (architectures: "
                               f"{', '.join(config.architectures or ['none'])}); uptraining needs one")
        if not weights:
            from accelerate import init_empty_weights

            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=remote)
            model.tie_weights()  # as loading ties them (from_config leaves meta parameters untied)
            return empty_parameters(model)
        placement = {} if device is None or torch.device(device).type == "cpu" else {"device_map": {"": device}}
        model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=dtype, trust_remote_code=remote, **placement)
    except (OSError, ValueError, KeyError) as e:
        raise SurgeryError(f"cannot load the {role} {source.spec}: {str(e).splitlines()[0]}") from None
    return model


def empty_parameters(model):
    """`model` with each parameter on the meta device replaced by an uninitialised CPU tensor of its shape (tied ones
    stay tied): distinct storages, as an optimizer and accelerate's FSDP2 preparation need, that the system does not
    back with memory until written (FSDP2 moves the model to the meta device before the shards arrive)."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
    return model


def load_trusted_tokenizer(source: Source, role: str = "model", trusted: bool = False):
    """The checkpoint's tokenizer, trusted as `load_causal_lm` trusts the same folder (surgery.runtime.load_tokenizer
    with the model's or the teacher's trust)."""
    return runtime.load_tokenizer(source, trust_remote_code=trust_for(source, role, trusted))


def check_seq_len(model, seq_len: int, spec: str) -> None:
    ctx = context_length(model.config)
    if ctx and seq_len > ctx:
        raise SurgeryError(f"--seq-len {seq_len} is longer than the context of {spec} ({ctx} tokens)")


def teacher_source(record: dict, teacher: str | None) -> Source | None:
    """The teacher: --teacher when given, else the source named in surgery.json (its folder if still there)."""
    if teacher:
        return resolve_source(teacher)
    src = record.get("source") or {}
    folder = local_source_folder(record)
    if folder is not None:
        local = record.get(LOCAL_KEY) or {}
        return Source(folder, local.get("source_spec") or src.get("spec") or str(folder), src.get("revision"),
                      local.get("gguf_path") or src.get("gguf_file"))
    if src.get("spec"):
        return resolve_source(src["spec"], revision=src.get("revision"))
    return None


def vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def check_teacher(student, teacher, student_tok, teacher_source: Source, trusted: bool = False) -> None:
    teacher_folder, teacher_spec = teacher_source.folder, teacher_source.spec
    if vocab_size(student) != vocab_size(teacher):
        raise SurgeryError(f"the teacher {teacher_spec} has a different vocabulary ({vocab_size(teacher)} logits, the "
                           f"student has {vocab_size(student)}): distillation needs the same tokenizer")
    if any(Path(teacher_folder).glob("tokenizer*")):
        teacher_tok = load_trusted_tokenizer(teacher_source, "teacher", trusted)
        if teacher_tok.get_vocab() != student_tok.get_vocab():
            raise SurgeryError(f"the teacher {teacher_spec} has a different vocabulary (its tokenizer differs from "
                               "the student's): distillation needs the same tokenizer")


def enable_checkpointing(model, spec: str) -> None:
    """Activation (gradient) checkpointing, non-reentrant (works with frozen inputs and DDP's no_sync)."""
    try:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    except ValueError as e:
        raise SurgeryError(f"--gradient-checkpointing: {spec} does not support it ({str(e).splitlines()[0]})") from None


def disable_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def checkpoint_dtype(folder: Path, config: dict) -> torch.dtype:
    """The dtype the input checkpoint stores its floating weights in (written back in the same)."""
    name = config.get("dtype") or config.get("torch_dtype")
    if name in DTYPES:
        return DTYPES[name]
    from ..checkpoint.tensors import CheckpointReader

    counts: dict[torch.dtype, int] = {}
    try:
        with CheckpointReader(folder) as reader:
            for info in reader.tensors.values():
                if info.dtype.is_floating_point:
                    counts[info.dtype] = counts.get(info.dtype, 0) + int(torch.Size(info.shape).numel())
    except SurgeryError:  # pickle-only checkpoints: saved as safetensors in fp32
        pass
    return max(counts, key=counts.get) if counts else torch.float32


def shipped_code_files(folder: Path) -> list[Path]:
    """Python files a checkpoint ships for `auto_map` (all top-level *.py: modules may import siblings), each a
    regular file inside the folder (surgery.checkpoint.source.inside_file)."""
    return [inside_file(folder, p, "code file") for p in sorted(Path(folder).glob("*.py")) if not p.is_dir()]


def save_uptrained(model, state: dict | None, source: Source, dst: Path, dtype: torch.dtype, max_shard_size: str,
                   checkpointing: bool = False) -> None:
    """Save `model` into `dst` like its input: safetensors in the input dtype, side files and custom code.
    `state`: the gathered full state dict when the parameters were sharded (FSDP, DeepSpeed), else None."""
    model.config.use_cache = True
    if checkpointing:
        disable_checkpointing(model)
    model.to(dtype)
    if state is not None:  # gathered tensors are separate copies: a tied weight is saved once, as without sharding
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k not in tied}
    model.save_pretrained(dst, state_dict=state, max_shard_size=max_shard_size)
    copy_side_files(source.folder, dst)
    for f in shipped_code_files(source.folder):
        if not (dst / f.name).exists():
            shutil.copyfile(f, dst / f.name)


def uptrained_record(source: Source, uptraining: dict) -> dict:
    """The input's surgery.json (or a new one) with an "uptraining" record; earlier ones move to a history."""
    record = read_record(source.folder)
    if not record:
        record = {"toolkit": "surgery", "version": __version__, "kind": "uptrained"}
    if "uptraining" in record:
        record.setdefault("previous_uptraining", []).append(record["uptraining"])
    record["uptraining"] = uptraining | {"created": now(), "input": {"spec": source_name(source)},
                                         LOCAL_KEY: {"input_folder": str(Path(source.folder).absolute())}}
    return record
