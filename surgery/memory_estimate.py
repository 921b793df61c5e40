"""Rough sizes for `surgery run --dry-run`: bytes on disk, tokens processed and peak memory of each step.

Peak memory is the peak resident set (RSS) of the step's process, in bytes, per process. P parameters, b bytes per
weight, T trainable parameters, H hidden size, I MLP width, L layers, V vocabulary, m micro-batch, s sequence
length, n = m s tokens per forward pass:
- every command: the interpreter, torch, transformers and their caches, measured on this project's machines
  (RUNTIME; tests/estimate/test_estimate.py checks the whole estimate against measured peaks of tiny models).
- convert, streamed (mean/first/random/talking-heads): about 3 x the largest tensor (read, pooled, written).
- convert with calibration (aligned, switchhead): layer streaming, one fp32 decoder layer at a time plus the
  embeddings, activations and fits (surgery/estimate.py, the same model `surgery convert --dry-run` prints; the
  source's config is needed, else the fp32 model 4P plus its activations).
- check: one model at a time in the check dtype (P x 4 for fp32) plus one batch's logits and their softmax
  temporaries (3 x 4 x m s V).
- uptrain (AdamW, fp32): weights 4P, AdamW's two moments 8T, the gradients 4T, a fp32 teacher 4P when distilling,
  and activations n L (8H + 4I) x 4 bytes (the tensors a Llama-like block saves for its backward pass; with
  gradient checkpointing n L H x 4 plus one block's). Within one optimizer step the gradients grow as the
  activations are freed, so the two overlap only with gradient accumulation (m < the sequences per step): the
  step needs max(activations, 4T), or their sum when accumulating. The losses take the final hidden states and
  project 256 positions at a time (surgery/training/heads.py), ~6 x 4 x 256 V of temporaries; under FSDP, which
  keeps the whole logits, and for a model whose logits are not its output projection's (soft-capping:
  `chunked_head`), the whole fp32 logits, their gradient and the softmax's temporaries, 3 x 4 x n V. Weights, moments and gradients are divided by the processes under FSDP.
  With --hidden-weight the teacher's hidden states, n (L + 1) H x 4, wait for the loss (the student's are among
  the saved activations already).
Measured against these (BENCHMARKS.md, "Memory estimates"): within about 25% on SmolLM2-135M and tiny models.

`uptrain_memory_per_process` breaks an uptraining process's memory down by phase (loading, a training step, a
checkpoint, the final save) and term, host and GPU apart, the main process and the others apart: what
`run --dry-run` and `uptrain --dry-run` print for FSDP worlds (BENCHMARKS.md, "Per-process FSDP checkpoints",
holds it to measured peaks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .arch import attention_shape
from .dtypes import DTYPE_BYTES


MB = 1 << 20
# Peak RSS of each command with a negligible model (interpreter, libraries, tokenizer, data, allocator caches).
RUNTIME = {"convert": 300 * MB, "check": 600 * MB, "uptrain": 600 * MB, "teacher": 470 * MB}
LOSS_CHUNK = 256  # positions per chunk of the uptraining losses (surgery/training/losses.py CHUNK_POSITIONS)


@dataclass
class ModelStats:
    params: int
    dtype_bytes: int
    largest_tensor_bytes: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int = 0  # MLP width (0: unknown, 4 x hidden assumed)
    config: dict | None = None  # the source's config.json (for the calibrated conversions' streaming estimate)

    @property
    def mlp(self) -> int:
        return self.intermediate or 4 * self.hidden

    @property
    def bytes(self) -> int:
        return self.params * self.dtype_bytes


def _shape(config: dict) -> dict:
    shape = attention_shape(config)
    shape["vocab"] = int(config.get("vocab_size") or 0)
    inner = config.get("intermediate_size") or config.get("n_inner") or config.get("ffn_dim") or 0
    shape["intermediate"] = int(inner) if isinstance(inner, (int, float)) and inner > 0 else 0
    return shape


def stats_from_folder(folder: Path, allow_pickle: bool = False) -> ModelStats:
    from .checkpoint.source import load_config
    from .checkpoint.tensors import CheckpointReader, dtype_size

    config = load_config(folder)
    with CheckpointReader(folder, allow_pickle=allow_pickle) as reader:
        infos = list(reader.tensors.values())
    floats = [t for t in infos if t.dtype.is_floating_point] or infos
    main = max(floats, key=lambda t: t.numel)
    largest = max(t.numel * dtype_size(t.dtype) for t in infos)
    shape = _shape(config)
    return ModelStats(sum(t.numel for t in infos), dtype_size(main.dtype), largest, shape["layers"], shape["hidden"],
                      shape["heads"], shape["kv_heads"], shape["head_dim"], shape["vocab"], shape["intermediate"], config)


def stats_from_config(config: dict) -> ModelStats:
    """Parameters of a config's model, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = dict(config)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    size = DTYPE_BYTES.get(dtype, 4)
    shape = _shape(config)
    return ModelStats(sum(p.numel() for p in params), size, max(p.numel() for p in params) * size, shape["layers"],
                      shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["vocab"],
                      shape["intermediate"], config)


def after_convert(stats: ModelStats, options) -> ModelStats:
    """The converted model's size: K/V projections shrink to the kind's K/V heads (mqa/gqa); other kinds stay close
    to the source."""
    dtype_bytes = DTYPE_BYTES.get(getattr(options, "dtype", "auto"), stats.dtype_bytes)
    groups = options.kind.converted_kv_heads(options.kind_options, stats.kv_heads)
    removed = stats.layers * 2 * stats.hidden * stats.head_dim * max(stats.kv_heads - groups, 0)
    return replace(stats, params=stats.params - removed, kv_heads=groups, dtype_bytes=dtype_bytes, config=None)


def convert_memory(stats: ModelStats, options) -> int:
    calibrated = options.kind.calibrates(options.kind_options)
    if calibrated and stats.config is not None:
        return streamed_calibration(stats, options).host_bytes
    if calibrated:
        tokens = min(getattr(options, "calib_tokens", 8192) or 8192, 2048)
        return RUNTIME["convert"] + stats.params * 4 + tokens * stats.hidden * stats.layers * 4 * 4
    return RUNTIME["convert"] + 3 * stats.largest_tensor_bytes


def streamed_calibration(stats: ModelStats, options, throughput=None):
    """The calibrated conversion's estimate (the kind's cost model, surgery/estimate.py) for a convert step."""
    from .estimate import Throughput

    dtype = {4: "float32", 2: "bfloat16"}.get(stats.dtype_bytes, "float32")
    device = getattr(options, "device", "cpu") or "cpu"
    device = "cpu" if device == "auto" else device
    return options.kind.calibration_estimate(stats.config, options.kind_options, dtype=dtype, device=device,
                                             throughput=throughput or Throughput("unmeasured", 1.0, 1.0))


def check_memory(stats: ModelStats, options) -> int:
    """One model at a time in the check dtype, plus one batch's logits and their softmax temporaries."""
    bytes_ = DTYPE_BYTES.get(getattr(options, "dtype", "float32"), 4)
    logits = 3 * 4 * options.batch_size * options.seq_len * max(stats.vocab, stats.hidden)
    return RUNTIME["check"] + stats.params * bytes_ + logits


def trainable_params(stats: ModelStats, train: str) -> int:
    """all: every parameter; attention / new: the attention projections (an upper bound for `new`)."""
    if train in ("attention", "new"):
        return stats.layers * stats.hidden * (2 * stats.heads + 2 * stats.kv_heads) * stats.head_dim
    return stats.params


# config.json keys of a non-linear step after the output projection (Gemma 2/3's soft-capping): surgery/training/
# heads.py's OutputHead.of then finds the logits are not the projection of what it feeds it and keeps whole logits
# (a scaling, Cohere's or Granite's, is linear: it scales the hidden states the head is fed, and the head stays)
AFTER_PROJECTION = {"final_logit_softcapping": None}


def chunked_head(config: dict | None) -> bool:
    """Whether uptraining can move this model's output projection into its losses (surgery/training/heads.py): no
    step after the projection. Unknown (no config): assumed so."""
    return not any((config or {}).get(key, neutral) not in (None, neutral) for key, neutral in AFTER_PROJECTION.items())


def uptrain_memory(stats: ModelStats, options, teacher: ModelStats | None, processes: int) -> int:
    procs = max(processes, 1)
    trainable = trainable_params(stats, getattr(options, "train", "all") or "all")
    tokens = options.micro_batch * options.seq_len
    block = tokens * (8 * stats.hidden + 4 * stats.mlp) * 4  # one block's saved activations, fp32
    if options.gradient_checkpointing:
        activations = tokens * stats.hidden * 4 * stats.layers + block
    else:
        activations = block * stats.layers
    gradients = 4 * trainable // procs
    sequences = max(options.batch_tokens // options.seq_len, 1)
    accumulating = options.micro_batch * procs < sequences
    step = activations + gradients if accumulating else max(activations, gradients)
    if procs > 1 or not chunked_head(stats.config):
        # FSDP keeps the whole logits (surgery/training/recipe_setup.py), DDP the projection chunks: size for FSDP; a
        # model with a step after its projection keeps them too: the fp32 logits, their gradient, the softmax's
        # temporaries
        logits = 3 * 4 * tokens * stats.vocab
    else:
        logits = 6 * 4 * min(tokens, LOSS_CHUNK) * stats.vocab
    weights = 4 * stats.params // procs + 8 * trainable // procs
    teacher_bytes = teacher_memory(teacher, procs) if teacher else 0
    if teacher and getattr(options, "hidden_weight", 0):
        teacher_bytes += 4 * tokens * (stats.layers + 1) * stats.hidden
    return RUNTIME["uptrain"] + weights + teacher_bytes + step + logits


def teacher_memory(teacher: ModelStats, processes: int) -> int:
    """The frozen KD teacher's fp32 weights on one process: whole on one process; under FSDP (several processes,
    surgery/training/accelerator.py shards the teacher per decoder layer like the student) its shard plus the one layer
    gathered for the forward."""
    whole = 4 * teacher.params
    if processes <= 1:
        return whole
    return whole // processes + whole // max(teacher.layers, 1)


def uptrain_tokens(options) -> int:
    steps = -(-options.tokens // options.batch_tokens)
    return steps * options.batch_tokens


# ------------------------------------------------------------------------------ per process: host and GPU memory


@dataclass
class ProcessMemory:
    """Peak memory of one uptraining process, by term, for the main process and for each other one: `device` the
    accelerator's memory (on a CPU run everything is host memory and `device` is empty), `host` the process's RSS.
    A peak is the largest phase's sum (loading, a training step, a checkpoint, the final save), not the sum of all
    terms."""

    processes: int
    device_type: str
    host: dict[str, dict[str, int]]  # phase -> term -> bytes (the main process)
    device: dict[str, dict[str, int]]
    host_other: dict[str, dict[str, int]]  # the same for every other process
    device_other: dict[str, dict[str, int]]

    @staticmethod
    def _peak(phases: dict[str, dict[str, int]]) -> tuple[str, int]:
        if not phases:
            return "-", 0
        name = max(phases, key=lambda p: sum(phases[p].values()))
        return name, sum(phases[name].values())

    @property
    def host_peak(self) -> int:
        return self._peak(self.host)[1]

    @property
    def device_peak(self) -> int:
        return self._peak(self.device)[1]

    @property
    def host_peak_other(self) -> int:
        return self._peak(self.host_other)[1]

    @property
    def device_peak_other(self) -> int:
        return self._peak(self.device_other)[1]

    def lines(self) -> list[str]:
        from .units import human_bytes

        def table(label, phases):
            name, peak = self._peak(phases)
            if not phases:
                return [f"    {label}: - (a CPU run: everything is host memory)"]
            out = [f"    {label}: peak {human_bytes(peak)} ({name})"]
            for phase, terms in phases.items():
                out.append(f"      {phase:<16} " + ", ".join(f"{k} {human_bytes(v)}" for k, v in terms.items() if v))
            return out

        what = "GPU" if self.device_type == "cuda" else self.device_type
        out = [f"  memory per process ({self.processes} process{'es' * (self.processes > 1)}"
               + (", FSDP" if self.processes > 1 else "") + "):"]
        out += ["   main process (rank 0):"] + table(f"{what} memory", self.device) + table("host memory", self.host)
        if self.processes > 1:
            out += ["   every other process:"] + table(f"{what} memory", self.device_other)
            out += table("host memory", self.host_other)
        return out


def _root_params(stats: ModelStats, tied: bool) -> int:
    """Parameters outside the decoder layers: embeddings, the output head unless tied, the final norm."""
    return stats.vocab * stats.hidden * (1 if tied else 2) + stats.hidden


def layer_params(stats: ModelStats) -> int:
    """One decoder layer's parameters (the unit FSDP gathers at a time)."""
    return max((stats.params - _root_params(stats, _tied(stats))) // max(stats.layers, 1), 0)


def _tied(stats: ModelStats) -> bool:
    return bool((stats.config or {}).get("tie_word_embeddings", False))


def uptrain_memory_per_process(stats: ModelStats, options, teacher: ModelStats | None, processes: int,
                               device: str = "cuda", out_bytes: int | None = None) -> ProcessMemory:
    """Host and device memory of each uptraining process (surgery/training/loop.py, state.py), by phase and term.

    P parameters (T trainable), W processes (FSDP when W > 1: parameters, gradients and AdamW states sharded, the
    teacher too), c bytes of the compute dtype (2 under bf16 on CUDA, 4 on CPU), n = micro-batch x sequence length.
    - loading: under FSDP the main process alone reads the whole student in fp32 (4P) and the teacher in the
      compute dtype, plus the pages of the safetensors file being read (mapped, counted in RSS); the others build
      the models without weights (untouched memory) and receive their shards (surgery/training/accelerator.py
      `rank_zero_loads`). With the align stage (and for a kind with a training form, which this estimate does not
      see) every process reads the whole models, as one process does;
    - a training step: the fp32 master weights 4P/W, gradients 4T/W, AdamW's moments 8T/W, the teacher's shard
      c Pt/W; the units FSDP gathers in the compute dtype: the root (embeddings, output head, final norm: FSDP2 keeps
      a root unit gathered from its forward to the end of the backward, and the teacher's, which has no backward,
      from its first forward on) and its unsharded gradients before their reduce-scatter, plus two decoder layers
      (the one running and the one prefetched); the micro-batch's activations and logits (`uptrain_memory`'s count;
      under FSDP the whole [n, V] logits, their gradients and the teacher's logits);
    - a checkpoint: this process's shards (per-process checkpoints, surgery/training/state.py), written from the
      tensors' memory by safetensors (>= 0.8; older versions build each file's bytes first), from a GPU through a
      host copy of the larger file's tensors (AdamW's shard, 8T/W);
    - the final save (main process): the whole model gathered to the host in fp32 (4P) and its copy in the output
      dtype.
    Not counted: the CUDA context and allocator caches (about 1 GB of GPU memory), NCCL's buffers, fragmentation."""
    W = max(processes, 1)
    cuda = device == "cuda"
    c = 2 if cuda else 4
    out_bytes = out_bytes or stats.dtype_bytes
    P, T = stats.params, trainable_params(stats, getattr(options, "train", "all") or "all")
    n = options.micro_batch * options.seq_len
    runtime = RUNTIME["uptrain"]
    block = n * (8 * stats.hidden + 4 * stats.mlp) * 4
    if options.gradient_checkpointing:
        activations = n * stats.hidden * 4 * stats.layers + block
    else:
        activations = block * stats.layers
    sequences = max(options.batch_tokens // options.seq_len, 1)
    accumulating = options.micro_batch * W < sequences
    gradients = 4 * T // W
    chunked = W == 1  # surgery/training/recipe_setup.py setup_heads: the chunked output head is off under FSDP
    logits = 6 * 4 * min(n, LOSS_CHUNK) * stats.vocab if chunked else 3 * 4 * n * stats.vocab
    step = {"weights (fp32 shard)": 4 * P // W, "AdamW moments (shard)": 8 * T // W}
    if accumulating:  # gradients and activations alive together
        step |= {"gradients (fp32 shard)": gradients, "activations": activations}
    else:  # the gradients grow as the activations are freed
        step["activations / gradients"] = max(activations, gradients)
    sharded = W > 1
    if sharded:
        root = _root_params(stats, _tied(stats))
        step["gathered root unit + its gradients"] = 2 * c * root
        step["gathered layers (2)"] = 2 * c * layer_params(stats)
    step["logits and loss"] = logits
    if teacher is not None:
        step["teacher (shard)"] = c * teacher.params // W
        if sharded:
            step["teacher root unit (kept gathered)"] = c * _root_params(teacher, _tied(teacher))
        step["teacher logits"] = 0 if chunked else 4 * n * teacher.vocab
        if getattr(options, "hidden_weight", 0):
            step["teacher hidden states"] = 4 * n * (stats.layers + 1) * stats.hidden
    resident = {k: v for k, v in step.items() if k in ("weights (fp32 shard)", "AdamW moments (shard)",
                                                        "teacher (shard)", "teacher root unit (kept gathered)")}
    save_buffer = 8 * T // W if cuda else 0  # the host copy of the larger shard file (CPU: written in place)
    loading = {"student (fp32, whole)": 4 * P, "file being read (mapped)": stats.dtype_bytes * P}
    if teacher is not None:
        loading["teacher (whole)"] = c * teacher.params
    stages = str(getattr(options, "stage", "") or "")
    loading_other = loading
    if sharded and "align" not in stages:  # rank 0 reads; the others receive their shards
        loading_other = {"student (fp32 shard)": 4 * P // W,
                         **({"teacher (shard)": c * teacher.params // W} if teacher is not None else {})}
    # the final save: one process saves the model it holds (a copy in the output dtype); FSDP gathers it first
    final = {"whole model gathered (fp32)": 4 * P if sharded else 0, "output copy": out_bytes * P if out_bytes != 4 else 0}

    def with_runtime(phases):
        return {name: {"runtime": runtime, **terms} for name, terms in phases.items()}

    if cuda:
        device_phases = {"training step": step, "checkpoint": resident}
        host = {"loading": loading, "checkpoint": {"checkpoint save buffers": save_buffer}}
        host_main = with_runtime(host | {"final save": final})
        return ProcessMemory(W, device, host_main, device_phases, with_runtime(host | {"loading": loading_other}),
                             device_phases)
    phases = {"loading": loading, "training step": step,
              "checkpoint": resident | {"checkpoint save buffers": save_buffer}}
    other = with_runtime(phases | {"loading": loading_other})
    final_main = resident | final
    return ProcessMemory(W, device, with_runtime(phases | {"final save": final_main}), {}, other, {})


def teacher_pass_memory(stats: ModelStats, options, device: str = "cuda") -> ProcessMemory:
    """Host and device memory of `surgery teacher` (surgery/training/teacher_pass.py, one process, no gradients): the
    teacher loaded whole on the host in the compute dtype (c bytes: 2 under bf16, 4 in fp32) from its mapped file,
    then moved to the device; a forward of m windows of s tokens (n = m s): the logits [n, V] in the compute dtype,
    one layer's activations n (4H + 3I) c (freed layer by layer: no gradients), and one window's top-K temporaries
    (its fp32 logits, the copy with the top K masked out and the softmax's, 3 x 4 s V). The stored top-K leave in
    shards of a few MB. Within 10% of the measured peak RSS of a 35M-parameter Llama on CPU
    (tests/estimate/test_teacher_pass_memory.py)."""
    cuda = device == "cuda"
    precision = getattr(options, "precision", "auto")
    c = 2 if (precision == "bf16" or (precision == "auto" and cuda)) else 4
    P, n, s = stats.params, options.micro_batch * options.seq_len, options.seq_len
    runtime = RUNTIME["teacher"]
    loading = {"runtime": runtime, "teacher (whole)": c * P, "file being read (mapped)": stats.dtype_bytes * P}
    forward = {"teacher weights": c * P, "logits (micro-batch)": c * n * stats.vocab,
               "top-K temporaries (one window, fp32)": 3 * 4 * s * stats.vocab,
               "activations (one layer, no gradients)": n * (4 * stats.hidden + 3 * stats.mlp) * c}
    if cuda:
        return ProcessMemory(1, device, {"loading": loading}, {"teacher pass": forward}, {}, {})
    return ProcessMemory(1, device, {"loading": loading, "teacher pass": {"runtime": runtime, **forward}}, {}, {}, {})
