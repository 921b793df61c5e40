"""What a calibrated conversion will cost before it runs: peak host/device memory and seconds per decoder layer.

Memory is the layer-streaming model of `surgery.calibration.stream.estimate_peak_bytes` (the Python process, one
float32 decoder layer, the embeddings, the residual stream up to its spill budget and one chunk's activations, one
chunk's scratch; the residual stream past the budget is on disk, reported apart) plus what it leaves out:
the fits' float64 matrices (second moments of the layer input, the query and output refits' normal equations);
the checkpoint is read one tensor at a time (one tensor in its dtype, not the layer), and the embeddings are freed
once the embedding step is done, so they and a layer are never resident together.

Time per layer is the layer's floating-point work, counted from the shapes and the algorithm (below), divided by
the device's matmul throughput measured on the spot (`probe_throughput`: about one second of float32 and float64
matrix products). Each kind counts its own work beside its code (its `cost.py`: surgery/kv/cost.py,
surgery/switchhead/cost.py, surgery/mla/cost.py, surgery/swa/cost.py, surgery/hybrid/cost.py), from the shared
pieces here (`LayerShape`, `Flops`, `attention_flops`, `mlp_flops`).
The float32 and float64 work at the probe's rates, divided by `EFFICIENCY` (the rest of the work, measured once),
gives the CPU seconds per layer, whatever the machine's load, and the wall seconds per layer at the load of the
moment of the probe (a machine shared with other jobs gives a long run a different share than a one-second probe).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .arch import attention_shape
from .dtypes import DTYPE_BYTES

# The share of the probe's matmul rate a calibration reaches overall (its other work: reading and casting the layer,
# norms, softmax, rotary, small eigendecompositions, Python). Measured once, on the Qwen2.5-3B layout (2 layers,
# 1024 tokens, CPU time: 7.9 s per layer for 4.8 s of counted matmul work at the probe's rate); BENCHMARKS.md checks
# it on the other layouts.
EFFICIENCY = 0.6
DEFAULT_WINDOW = 512  # calibration window (surgery/calibration/text.py)
QUERY_SAMPLES = 128  # query positions per window in the query refit (QueryRefit.samples)
QUERY_TOPK = 32


@dataclass(frozen=True)
class Throughput:
    """Measured matmul throughput of a device, flop/s: per wall-clock second (what a run sees now, other jobs
    included) and, on the CPU, per CPU second of this process (the machine's own speed, whatever the load)."""

    device: str
    float32: float
    float64: float
    float32_cpu: float | None = None
    float64_cpu: float | None = None


def _rate(device: torch.device, dtype: torch.dtype, n: int, seconds: float) -> tuple[float, float]:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    a @ b  # warm-up (allocations, kernel choice)
    sync(device)
    count, start, cpu = 0, time.perf_counter(), time.process_time()
    while True:
        a @ b
        count += 1
        if count % 4 == 0:
            sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                flops = 2 * n**3 * count
                return flops / elapsed, flops / max(time.process_time() - cpu, 1e-9)


def probe_throughput(device: torch.device | str = "cpu", seconds: float = 1.0, threads_float32: int | None = None) -> Throughput:
    """float32 and float64 matmul flop/s of `device`, in about `seconds` (half each). On the CPU, float32 runs with
    `threads_float32` threads (the forward passes' count; default the current one) and float64 with one thread, as
    the merge's fits do (surgery/runtime.py: threads)."""
    from .runtime import threads

    device = torch.device(device)
    if device.type == "cuda":
        return Throughput(str(device), _rate(device, torch.float32, 8192, seconds / 2)[0],
                          _rate(device, torch.float64, 4096, seconds / 2)[0])
    with threads(threads_float32 or torch.get_num_threads()):
        f32 = _rate(device, torch.float32, 1024, seconds / 2)
    with threads(1):
        f64 = _rate(device, torch.float64, 1024, seconds / 2)
    return Throughput(str(device), f32[0], f64[0], f32[1], f64[1])


@dataclass(frozen=True)
class LayerShape:
    """What the cost of one decoder layer depends on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    mlp_matrices: int  # 3 for gated MLPs (SwiGLU, GeGLU), 2 otherwise
    qkv_bias: bool
    rotary_dims: int | None = None  # dims of each head RoPE rotates (None: all of them)

    @property
    def rotary(self) -> int:
        return self.head_dim if self.rotary_dims is None else self.rotary_dims


GATED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "mixtral", "olmo", "olmo2")


def layer_shape(config: dict) -> LayerShape:
    a = attention_shape(config)
    inter = int(config.get("intermediate_size") or config.get("n_inner") or 4 * a["hidden"])
    mtype = str(config.get("model_type", ""))
    bias = bool(config.get("attention_bias")) or mtype == "qwen2" or mtype.startswith("gpt")
    fraction = config.get("partial_rotary_factor", config.get("rotary_pct", 1.0))
    rotary = 0 if mtype.startswith("gpt") and mtype != "gpt_neox" else int(a["head_dim"] * float(fraction)) // 2 * 2
    return LayerShape(a["layers"], a["hidden"], a["heads"], a["kv_heads"], a["head_dim"], inter,
                      3 if mtype in GATED else 2, bias, rotary)


@dataclass
class Flops:
    float32: float = 0.0
    float64: float = 0.0

    def seconds(self, rate: Throughput) -> float:
        return (self.float32 / rate.float32 + self.float64 / rate.float64) / EFFICIENCY

    def cpu_seconds(self, rate: Throughput) -> float | None:
        if rate.float32_cpu is None or rate.float64_cpu is None:
            return None
        return (self.float32 / rate.float32_cpu + self.float64 / rate.float64_cpu) / EFFICIENCY


def attention_flops(s: LayerShape, tokens: int, window: int) -> float:
    """One attention module over the tokens: projections and the (full-square) score and value products."""
    proj = 2 * tokens * s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + 2 * tokens * s.heads * s.head_dim * s.hidden
    return proj + 4 * tokens * window * s.heads * s.head_dim


def mlp_flops(s: LayerShape, tokens: int) -> float:
    """One MLP over the tokens."""
    return 2 * tokens * s.mlp_matrices * s.hidden * s.intermediate


def largest_layer_tensor(s: LayerShape) -> int:
    """Elements of a decoder layer's largest matrix (read from the checkpoint one at a time)."""
    return max(s.hidden * s.intermediate, s.hidden * s.heads * s.head_dim, s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim)


@dataclass(frozen=True)
class CalibratedCost:
    """A calibrated conversion's cost model, as its kind (surgery/kinds) describes it to `estimate_calibrated`."""

    name: str  # what the estimate is of ("estimate for NAME on cpu ...")
    layer_flops: Callable[[LayerShape, int, int], Flops]  # (shape, tokens, window) -> one layer's work
    fit_bytes: Callable[[LayerShape, int], int]  # (shape, chunk tokens) -> float64 fits alive at once
    eager: bool = False  # eager attention: one window per chunk, scores, softmax and maps kept (streaming model)
    # (shape, tokens, window, chunk tokens) -> memory terms of one layer's step beyond the streaming model's
    extra_memory: Callable[[LayerShape, int, int, int], dict[str, int]] | None = None
    # (shape, tokens, window, chunk tokens) -> bytes of the float32 tensors the calibration holds at once (the
    # residual stream up to its spill budget, one chunk's working set), when the kind knows them better than the
    # streaming model's generic count (which is the aligned merge's)
    activations: Callable[[LayerShape, int, int, int], int] | None = None


@dataclass
class Estimate:
    kind: str
    device: str
    layers: int
    tokens: int
    host_bytes: int
    device_bytes: int
    seconds_per_layer: float
    seconds: float  # all layers (the embedding step and the writing excluded)
    cpu_seconds_per_layer: float | None  # CPU seconds of the process (CPU runs): independent of the machine's load
    flops_per_layer: Flops
    throughput: Throughput
    memory: dict  # the terms
    chunk_windows: int = 1  # calibration windows per chunk (surgery/calibration/chunks.py, or --calib-chunk)
    window: int = DEFAULT_WINDOW

    def lines(self) -> list[str]:
        from .units import human_bytes

        gf = self.flops_per_layer
        t = self.throughput
        out = [f"estimate for {self.kind} on {self.device} ({self.layers} layers, {self.tokens} calibration tokens):",
               f"  peak host memory    {human_bytes(self.host_bytes)}",
               f"  peak device memory  {human_bytes(self.device_bytes) if self.device_bytes else '- (CPU run)'}",
               f"  calibration chunk   {self.chunk_windows} window{'s' * (self.chunk_windows > 1)} of "
               f"{self.window} tokens per pass (--calib-chunk N changes it)",
               f"  time per layer      {self.seconds_per_layer:.1f} s  ({gf.float32 / 1e9:.0f} GFLOP float32 at "
               f"{t.float32 / 1e9:.1f} GFLOP/s, {gf.float64 / 1e9:.0f} GFLOP float64 at {t.float64 / 1e9:.1f} GFLOP/s "
               f"measured now)",
               *([f"  CPU time per layer  {self.cpu_seconds_per_layer:.1f} s  (at {t.float32_cpu / 1e9:.1f} / "
                  f"{t.float64_cpu / 1e9:.1f} GFLOP per CPU second; the wall time on an idle machine at one thread)"]
                 if self.cpu_seconds_per_layer is not None else []),
               f"  all layers          {_duration(self.seconds)}",
               "  memory terms        " + ", ".join(f"{k} {human_bytes(v)}" for k, v in self.memory.items() if v)]
        return out


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def estimate_calibrated(config: dict, cost: CalibratedCost, tokens: int, *, dtype: str = "bfloat16",
                        device: str = "cpu", throughput: Throughput | None = None,
                        window: int = DEFAULT_WINDOW, chunk: int | None = None) -> Estimate:
    """Peak memory and time of a calibrated conversion with the cost model `cost` (its kind's) of the checkpoint
    described by `config` stored in `dtype`, on `device`, in chunks of `chunk` windows (default: the conversions'
    rule, surgery/calibration/chunks.py)."""
    from .calibration.chunks import chunk_tokens, chunk_windows
    from .calibration.stream import estimate_peak_bytes

    s = layer_shape(config)
    window = min(window, int(config.get("max_position_embeddings") or window), tokens)
    tokens = max(window, tokens // window * window)  # whole windows, as calibration cuts them
    dev = torch.device(device)
    rate = throughput or probe_throughput(dev)
    flops = cost.layer_flops(s, tokens, window)
    per_chunk = chunk_windows(config, window, requested=chunk, eager=cost.eager)
    chunked = chunk_tokens(per_chunk, tokens, window)
    terms = estimate_peak_bytes(config, tokens, dtype, eager=cost.eager, device=dev.type, window=window,
                                chunk_windows=per_chunk)
    if cost.activations is not None:
        terms["activations"] = cost.activations(s, tokens, window, chunked)
    fits = cost.fit_bytes(s, chunked)
    read = largest_layer_tensor(s) * DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)
    memory = {"runtime": terms["runtime"], "layer (float32)": terms["layer"], "embeddings": terms["embedding"],
              "activations": terms["activations"], "scratch": terms["scratch"], "fits (float64)": fits,
              "tensor being read": read}
    disk = {"residual stream on disk (not memory)": terms["spilled"]}
    # The embeddings are freed after the embedding step (LayerStream.release_embeddings): the peak is the larger of
    # that step and a layer's (its float32 weights, the tensor being read, one chunk's scratch and the fits).
    extra = cost.extra_memory(s, tokens, window, chunked) if cost.extra_memory else {}
    memory |= extra
    # the tensor being read: on the host on the CPU; on CUDA it crosses in the checkpoint's dtype and is cast there
    # (torch's cross-device `.to(device, float32)` copies, then converts on the device), so both copies are device memory
    layer_step = terms["layer"] + terms["scratch"] + fits + sum(extra.values()) + read
    # an embedding matrix kept in float32 (not a plain nn.Embedding, e.g. Gemma's scaled one) is read in the
    # checkpoint's dtype first: both copies exist for a moment
    word = int(config.get("vocab_size") or 0) * s.hidden
    width = DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)
    cast = word * width if width < 4 and terms["embedding"] >= 4 * word else 0
    memory["embedding being cast"] = cast
    embed_step = terms["embedding"] + cast
    if dev.type == "cpu":
        host = terms["runtime"] + terms["activations"] + max(embed_step, layer_step)
        on_device = 0
    else:
        memory["cuda runtime (host)"] = terms["cuda runtime"]
        host = terms["runtime"] + terms["cuda runtime"] + read + terms["embedding"]
        on_device = terms["activations"] + max(terms["embedding"], layer_step)  # the cast happens on the host
    per_layer = flops.seconds(rate)
    return Estimate(cost.name, str(dev), s.layers, tokens, int(host), int(on_device), per_layer, per_layer * s.layers,
                    flops.cpu_seconds(rate), flops, rate, memory | disk, per_chunk, window)
