"""How many calibration windows one chunk holds: the one rule every calibrated conversion and its cost model use.

Every per-layer stage of a calibrated conversion (aligned merge, MLA, SwitchHead) is a pass over the calibration
windows in chunks, adding each chunk to float64 sums; the result is the same maths whatever the chunking (to float
rounding), so the chunk trades memory for per-chunk overhead only. One chunk's working set grows with the model's
width: on the Llama-3-8B layout, 8 windows of 512 tokens hold ~1.6 GB of activations and scratch (attention
inputs and outputs, queries, keys, heads, one attention map per head, the MLP's three intermediate activations),
on SmolLM2-135M ~0.24 GB. So the chunk is the largest whole number of windows, 1 to `MAX_WINDOWS`, whose working
set (`chunk_bytes_per_token`, the streaming model's count) stays within `CHUNK_BUDGET`: small models keep 8
windows, an 8B model gets 1. `--calib-chunk N` overrides it.
"""

from __future__ import annotations

MAX_WINDOWS = 8  # the most windows a chunk holds (past it the per-chunk overhead is negligible on any model)
CHUNK_BUDGET = 256 << 20  # bytes of one chunk's activations and scratch (SmolLM2: 8 windows, Llama-3-8B: 1)
# eager attention (SwitchHead) keeps scores, probabilities and maps, and its router fits are ill-conditioned enough
# that batching windows moves them ~1% (surgery/switchhead/layers.py): one window by default
EAGER_WINDOWS = 1


def intermediate_size(config: dict, hidden: int) -> int:
    """The MLP's width, as the families' configs spell it (4 x hidden when none does)."""
    return int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden)


def chunk_terms_per_token(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, window: int,
                          eager: bool = False) -> tuple[int, int]:
    """float32 bytes one calibration token of a chunk holds at a layer step (the streaming model's count,
    `estimate_peak_bytes`), as (activations, scratch): the attention input (and its augmented copy), the source and
    converted outputs, the layer's output, queries, keys, heads and re-projected ones, cos/sin (eager: the input,
    output, heads and layer output); then one attention row per head (eager: the scores, softmax and maps besides),
    the MLP's three intermediate activations and the fused QKV projection."""
    if eager:
        width = 3 * hidden + heads * head_dim
    else:
        width = 4 * hidden + 3 * heads * head_dim + 3 * kv_heads * head_dim + head_dim
    probs = heads * window * (4 if eager else 1)
    return 4 * width, 4 * (probs + 3 * intermediate + (heads + 2 * kv_heads) * head_dim)


def chunk_bytes_per_token(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, window: int,
                          eager: bool = False) -> int:
    """Both terms of `chunk_terms_per_token`: what the chunk rule weighs against its budget."""
    return sum(chunk_terms_per_token(hidden, heads, kv_heads, head_dim, intermediate, window, eager))


def chunk_windows(config: dict, window: int, *, requested: int | None = None, eager: bool = False,
                  budget: int = CHUNK_BUDGET) -> int:
    """Windows per chunk for `config`'s model at calibration windows of `window` tokens: `requested` when given
    (`--calib-chunk`), else the most windows (1..MAX_WINDOWS; 1 for eager attention) whose working set fits
    `budget` bytes, and at least one."""
    if requested is not None:
        if requested < 1:
            from ..errors import SurgeryError

            raise SurgeryError(f"--calib-chunk must be at least 1 window, got {requested}")
        return int(requested)
    if eager:
        return EAGER_WINDOWS
    from ..arch import attention_shape

    a = attention_shape(config)
    per_token = chunk_bytes_per_token(a["hidden"], a["heads"], a["kv_heads"], a["head_dim"],
                                      intermediate_size(config, a["hidden"]), window)
    return windows_within(per_token, window, budget)


def windows_within(per_token: int, window: int, budget: int = CHUNK_BUDGET) -> int:
    """The most windows (1..MAX_WINDOWS) of `window` tokens at `per_token` bytes each that fit `budget`."""
    return max(1, min(MAX_WINDOWS, budget // (per_token * window)))


def chunk_tokens(windows_per_chunk: int, tokens: int, window: int) -> int:
    """Tokens in the largest chunk of a calibration of `tokens` tokens in windows of `window`."""
    return min(windows_per_chunk, max(1, tokens // window)) * window
