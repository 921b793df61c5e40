"""`surgery convert SRC --to mla`: a Llama-like checkpoint -> a plain `deepseek_v3` checkpoint (DeepSeek's
multi-head latent attention), loadable by transformers' own DeepseekV3ForCausalLM with no custom code.

Pipeline: refuse what has no DeepSeek equivalent (family spec, then config) -> second moments of every layer's
attention input on calibration text (streamed, surgery/mla/calibrate.py) -> one RoPE frequency set for the whole
model (DeepSeek has one rope_theta: the kept source frequencies must be k*s, k < D_r/2, for one stride s, chosen by
their contribution to the logits) -> per layer, the MLA weights (surgery/mla/factor.py) -> the writer. The MLP,
norms and embeddings are copied byte for byte (their names are DeepSeek's already); lm_head.weight is written even
when the source ties it.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..arch import spec_for
from ..checkpoint.atomic import check_output_path
from ..calibration.chunks import chunk_windows
from ..calibration.store import LayerStore
from ..calibration.text import calibration_text, context_of
from ..errors import SurgeryError
from ..checkpoint.writer import write_conversion
from ..precision import calibrating, resolve_precision
from ..runtime import load_tokenizer, pick_device
from ..checkpoint.source import Source
from ..checkpoint.tensors import CheckpointReader, PlannedTensor
from ..fitting.refit import QueryRefit
from .absorb import AbsorptionMoments, SourceProjections
from .body import BodyFold
from .calibrate import MLAGeometry, convert_pass, frequency_scores_pass
from .factor import FitWeights, MLAWeights, SourceAttention, mla_layer
from .families import MLAFamily, mla_family, rotating_layers
from .refusals import KIND, REFUSES
from .retrieval import RetrievalCalibration

if TYPE_CHECKING:
    from .options import MLAOptions

LATENT_EPS = 1e-6  # transformers' DeepseekV3 kv_a_layernorm epsilon (fixed; vLLM and llama.cpp read rms_norm_eps)
ATTENTION = ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


class Shape:
    """The source's attention sizes and the MLA sizes asked for."""

    def __init__(self, spec, config: dict, rank: int, rope_dim: int | None):
        self.layers, self.heads = spec.layers(config), spec.heads(config)
        self.kv_heads, self.head_dim, self.hidden = spec.kv_heads(config), spec.head_dim(config), spec.hidden(config)
        self.rotary_dims = rotary_dims(config, self.head_dim)
        self.rank, self.rope_dim = rank, self.rotary_dims if rope_dim is None else rope_dim
        full = 2 * self.kv_heads * self.head_dim
        if self.heads % self.kv_heads:
            raise SurgeryError(f"{self.kv_heads} K/V heads do not divide {self.heads} attention heads")
        if not 1 <= rank <= full:
            raise SurgeryError(f"--kv-rank must be between 1 and {full} (2 x {self.kv_heads} K/V heads x head_dim "
                               f"{self.head_dim}: the source's keys and values), got {rank}")
        if self.rope_dim % 2 or not 2 <= self.rope_dim <= self.rotary_dims:
            what = "head_dim" if self.rotary_dims == self.head_dim else "the source's rotary dims"
            raise SurgeryError(f"--rope-dim must be even (RoPE rotates pairs) and between 2 and {what} "
                               f"{self.rotary_dims}, got {self.rope_dim}")
        if self.rotary_dims != self.head_dim and spec.rotary_pairs != "interleaved":
            raise SurgeryError("mla converts partial rotary only with interleaved pairs (GLM's: the rotating pairs "
                               "are the head's first, the others join the no-position keys)")

    @property
    def full_rank(self) -> int:
        return 2 * self.kv_heads * self.head_dim


def rotary_dims(config: dict, head_dim: int) -> int:
    """The dims of each head that RoPE rotates (partial_rotary_factor, top-level or in rope_parameters)."""
    factor = config.get("partial_rotary_factor") or (config.get("rope_parameters") or {}).get("partial_rotary_factor")
    return int(head_dim * float(factor)) if factor else head_dim


def refuse_config(config: dict, family: MLAFamily | None = None) -> None:
    """What a Llama-like config can set that DeepSeek-V3 (as transformers, vLLM and llama.cpp read it) cannot (a
    family whose biases are absorbed (surgery/mla/families.py) keeps its attention_bias)."""
    for key in ("attention_bias", "mlp_bias"):
        if key == "attention_bias" and family is not None and family.biases:
            continue
        if config.get(key):
            raise SurgeryError(f"mla cannot convert {key}: DeepSeek-V3's projections have no biases")
    window, context = config.get("sliding_window"), config.get("max_position_embeddings")
    binds = not (window and context and int(window) >= int(context))  # a window over the whole context is none
    if window and config.get("use_sliding_window", True) and binds:
        raise SurgeryError("mla cannot convert sliding-window attention: DeepSeek-V3 attends over the whole context")
    if config.get("hidden_act") is None:
        raise SurgeryError("config.json has no hidden_act")


def source_frequencies(folder: Path, head_dim: int) -> torch.Tensor:
    """The source's rotary frequencies per pair, as its own transformers class computes them (any rope_type: the
    skeleton is built on the meta device, no weights read, no checkpoint code run)."""
    from transformers import AutoConfig

    return config_frequencies(AutoConfig.from_pretrained(folder, trust_remote_code=False), head_dim)


def config_frequencies(config, head_dim: int) -> torch.Tensor:  # head_dim: the dims that rotate
    """`source_frequencies` of a transformers config object (the dry run's, built from config.json's fields)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    if rotary is None:
        raise SurgeryError("mla needs a rotary position embedding (the model has none)")
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if "dynamic" in rope_type or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise SurgeryError(f"mla cannot convert RoPE {rope_type!r}: its frequencies or scale change with the "
                           "context, which DeepSeek-V3's default RoPE cannot follow")
    inv_freq = rotary.inv_freq.double()
    if 2 * inv_freq.numel() != head_dim:
        raise SurgeryError(f"mla needs RoPE over the whole head_dim ({2 * inv_freq.numel()} of {head_dim} dims "
                           "rotate)")
    return inv_freq


def source_theta(config: dict) -> float | None:
    """config.json's rope_theta (transformers 5 keeps it in rope_parameters), None where it states none."""
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    return float(theta) if theta else None


def geometric_strides(inv_freq: torch.Tensor, n: int, base: float | None = None) -> dict[int, float]:
    """Strides s whose frequencies inv_freq[k*s], k < n, are DeepSeek's: theta'^(-2k/(2n)) for one theta' (so the
    first is 1 and the ratios are constant; RoPE scalings such as llama3's rescale the low frequencies, which then
    only some strides avoid) -> theta' of each. With the source's `base` (its rope_theta), theta' is computed from
    it, base^(s*n/half), where it matches: the measured one carries float32 rounding (100000.124 for SmolLM2's
    100000 at full rope), and the exact value gives DeepSeek's rotary the source's own inv_freq, bit for bit."""
    out = {}
    half = inv_freq.numel()
    if abs(float(inv_freq[0]) - 1.0) > 1e-6:
        return out
    for s in range(1, half + 1):
        idx = [k * s for k in range(n)]
        if idx[-1] >= half:
            break
        if n == 1:
            out[s] = 10000.0
            continue
        ratio = float(inv_freq[s])
        expected = torch.tensor([ratio**k for k in range(n)], dtype=torch.float64)
        if torch.allclose(inv_freq[idx], expected, rtol=1e-5, atol=0):
            measured, exact = ratio ** (-n), base ** (s * n / half) if base else None
            out[s] = exact if exact and abs(measured / exact - 1) < 1e-4 else measured
    return out


def rope_strides(inv_freq: torch.Tensor, rope_dim: int, base: float | None = None) -> dict[int, float]:
    """`geometric_strides` for `rope_dim` rotary dims, refused when there is none."""
    strides = geometric_strides(inv_freq, rope_dim // 2, base)
    if not strides:
        raise SurgeryError(f"--rope-dim {rope_dim}: no {rope_dim // 2} of the source's rotary frequencies form "
                           "DeepSeek's geometric progression from 1 (its RoPE scaling rescales them); choose a "
                           "smaller --rope-dim")
    return strides


def choose_frequencies(scores: list[torch.Tensor] | None, strides: dict[int, float], rope_dim: int,
                       inv_freq: torch.Tensor, window: int) -> tuple[list[int], int, float, float]:
    """Among the strides DeepSeek's RoPE can express, the one whose kept frequencies k*s (k < rope_dim/2) would lose
    most if they lost their rotation (the smallest stride without scores); returns (frequencies, stride, theta',
    share of that loss kept).

    A dropped frequency stays in the no-position keys, unrotated: what it loses is its logit contribution
    (MHA2MLA's 2-norm score) times how far its rotation moves over the query-key distances calibration sees,
    1 - E[cos(w t)] for t uniform in [0, window) = 1 - sin(w W)/(w W). High frequencies lose all of it, those whose
    wavelength is much longer than the window almost nothing (measured on SmolLM2 at rank 96 + rope 32: the
    2-norm score alone kept every other frequency and gave 5.4x the source's perplexity)."""
    n = rope_dim // 2
    if scores is None:
        return [k * min(strides) for k in range(n)], min(strides), strides[min(strides)], 1.0
    angle = inv_freq * window
    moves = 1 - torch.sin(angle) / angle
    loss = torch.stack(scores).sum(0)[: inv_freq.numel()] / len(scores) * moves  # partial rotary: the first pairs
    loss = loss / loss.sum().clamp_min(1e-300)
    best = max(strides, key=lambda s: float(loss[[k * s for k in range(n)]].sum()))
    kept = [k * best for k in range(n)]
    return kept, best, strides[best], float(loss[kept].sum())


def target_config(config: dict, shape: Shape, theta: float, dtype: str | None) -> dict:
    """config.json of the DeepSeek-V3 output: dense (first_k_dense_replace = every layer), no q LoRA, MHA-shaped
    head counts, interleaved RoPE over the rope dims, no auto_map. The MoE fields describe no layer but must be
    integers (vLLM's weight loader counts experts from n_routed_experts), and llama.cpp asserts fewer expert groups
    than experts: one expert, zero groups."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "hidden_act", "max_position_embeddings",
            "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id", "attention_dropout")
    out = {k: config[k] for k in keep if k in config}
    out |= {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads, "num_key_value_heads": shape.heads,
        "kv_lora_rank": shape.rank, "q_lora_rank": None, "qk_rope_head_dim": shape.rope_dim,
        "qk_nope_head_dim": shape.head_dim, "v_head_dim": shape.head_dim,
        "first_k_dense_replace": shape.layers, "moe_intermediate_size": int(config["intermediate_size"]),
        "n_routed_experts": 1, "n_shared_experts": 1, "num_experts_per_tok": 1, "n_group": 0, "topk_group": 0,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "rms_norm_eps": LATENT_EPS, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_interleave": True, "attention_bias": False, "tie_word_embeddings": False, "use_cache": True,
        "dtype": dtype or config.get("dtype") or config.get("torch_dtype") or "float32",
    }
    return out


class Planner:
    """Every output tensor: the attention's five from `layer_weights`, the rest copied from the source."""

    def __init__(self, reader: CheckpointReader, spec, shape: Shape, layer_weights, dtype: torch.dtype | None,
                 config: dict | None = None, fold: BodyFold | None = None):
        self.reader, self.spec, self.shape, self.layer_weights, self.dtype = reader, spec, shape, layer_weights, dtype
        self.config, self.fold = config or {}, fold or BodyFold()
        self._cache: tuple[int, MLAWeights] | None = None

    def _weights(self, layer: int) -> MLAWeights:
        if self._cache is None or self._cache[0] != layer:
            self._cache = (layer, self.layer_weights(layer))
        return self._cache[1]

    def _attention(self, module: str, layer: int, dtype: torch.dtype) -> list[PlannedTensor]:
        s = self.shape
        shapes = {"q_proj": (s.heads * (s.head_dim + s.rope_dim), s.hidden),
                  "kv_a_proj_with_mqa": (s.rank + s.rope_dim, s.hidden), "kv_a_layernorm": (s.rank,),
                  "kv_b_proj": (s.heads * 2 * s.head_dim, s.rank), "o_proj": (s.hidden, s.heads * s.head_dim)}
        fields = {"q_proj": "q_proj", "kv_a_proj_with_mqa": "kv_a", "kv_a_layernorm": "kv_a_norm",
                  "kv_b_proj": "kv_b", "o_proj": "o_proj"}

        def producer(field: str):
            if field == "o_proj" and self.fold.changes("self_attn.o_proj.weight"):  # the residual branch ends here
                return lambda: self.fold.apply("self_attn.o_proj.weight",
                                               self._weights(layer).o_proj).to(dtype).contiguous()
            return lambda: getattr(self._weights(layer), field).to(dtype).contiguous()

        return [PlannedTensor(f"{module}.{name}.weight", dtype, shapes[name], produce=producer(fields[name]))
                for name in ATTENTION]

    def _is_qk_norm(self, name: str) -> bool:
        return self.spec.has_qk_norm(self.config) and any(
            re.search(self.spec.norm_pattern(which), name) for which in ("q", "k"))

    def plan(self) -> list[PlannedTensor]:
        planned, done = [], set()
        names = self.reader.names()
        for name in names:
            info = self.reader.tensors[name]
            dtype = self.dtype if (self.dtype and info.dtype.is_floating_point) else info.dtype
            hit = self.spec.locate(name)
            if hit is not None:
                module, layer, _, _ = hit
                if layer not in done:
                    done.add(layer)
                    planned += self._attention(module, layer, self.dtype or info.dtype)
                continue
            if name.endswith("rotary_emb.inv_freq") or self._is_qk_norm(name):
                continue  # q/k norms: absorbed into q_proj and the latent (surgery/mla/absorb.py)
            for out_name, rows in self.fold.mlp_tensors(name, info.shape[0]):
                planned.append(_copy(self.reader, name, out_name, dtype, self.fold, rows))
        hidden = self.shape.hidden
        for norm in self.fold.added_norms(self.shape.layers):  # weightless LayerNorms: RMSNorm weights of one
            planned.append(PlannedTensor(norm, self.dtype or torch.float32, (hidden,),
                                         produce=lambda d=self.dtype or torch.float32: torch.ones(hidden, dtype=d)))
        if "lm_head.weight" not in names:  # tied in the source: DeepSeek-V3 reads its own lm_head
            embed = next(n for n in names if n.endswith("embed_tokens.weight"))
            planned.append(_copy(self.reader, embed, "lm_head.weight",
                                 self.dtype or self.reader.tensors[embed].dtype, self.fold))
        return planned


def _copy(reader: CheckpointReader, name: str, out_name: str, dtype: torch.dtype,
          fold: BodyFold | None = None, rows: slice | None = None) -> PlannedTensor:
    """`name` (its `rows`: one half of a fused gate/up) written as `out_name`, with the family's constant folded in
    (`fold`, surgery/mla/body.py)."""
    info = reader.tensors[name]
    changed = fold is not None and fold.changes(out_name)
    if rows is not None:
        shape = (len(range(info.shape[0])[rows]), *info.shape[1:])
        fold = fold or BodyFold()
        return PlannedTensor(out_name, dtype, shape,
                             produce=lambda: fold.apply(out_name, reader.load(name)[rows]).to(dtype).contiguous())
    if dtype == info.dtype and not reader.is_pickle and not changed:
        return PlannedTensor(out_name, dtype, info.shape, raw_source=(reader, name))
    if changed:
        return PlannedTensor(out_name, dtype, info.shape,
                             produce=lambda: fold.apply(out_name, reader.load(name)).to(dtype).contiguous())
    return PlannedTensor(out_name, dtype, info.shape, produce=lambda: reader.load(name).to(dtype).contiguous())


def _projection_names(reader: CheckpointReader, spec, layers: int, family: MLAFamily | None = None,
                      biases: dict[tuple[int, str], str] | None = None) -> dict[tuple[int, str], str]:
    """(layer, projection) -> weight name; the q/k/v biases of a family that absorbs them go into `biases`."""
    found: dict[tuple[int, str], str] = {}
    for name in reader.names():
        hit = spec.match(name)
        if hit is None:
            continue
        layer, proj, param = hit
        if param == "bias":
            if family is None or not family.biases or proj == spec.o or biases is None:
                raise SurgeryError(f"mla cannot convert attention biases ({name}): DeepSeek-V3's projections have "
                                   "none")
            biases[(layer, proj)] = name
            continue
        found[(layer, proj)] = name
    for layer in range(layers):
        for proj in spec.projections:
            if (layer, proj) not in found:
                raise SurgeryError(f"the checkpoint has no {proj} weight for layer {layer}")
    return found


def _qk_norm_names(reader: CheckpointReader, spec, config: dict) -> dict[tuple[int, str], str]:
    """(layer, "q"|"k") -> the per-head q/k norm's weight (a norm with a bias has no RMSNorm form: refused)."""
    if not spec.has_qk_norm(config):
        return {}
    found = {}
    for which in ("q", "k"):
        pattern = re.compile(spec.norm_pattern(which))
        for name in reader.names():
            m = pattern.search(name)
            if m is None:
                continue
            if m.group("param") != "weight":
                raise SurgeryError(f"mla cannot absorb a q/k norm with a bias ({name})")
            if reader.tensors[name].shape[-1:] != (spec.head_dim(config),) or len(reader.tensors[name].shape) != 1:
                raise SurgeryError(f"mla absorbs per-head q/k norms of head_dim weights; {name} has shape "
                                   f"{tuple(reader.tensors[name].shape)}")
            found[(int(m.group("layer")), which)] = name
    return found


def _family_record(family: MLAFamily | None, absorbing: bool, absorb: bool,
                   residuals: dict[int, dict[str, tuple[float, float]]]) -> dict:
    """surgery.json's `mla.family` (verdict and why) and, for an approximate family, `mla.absorption`: per projection
    the mean relative residual over layers of the linear fit and of dropping the term (surgery/mla/absorb.py)."""
    out = {"family": {"verdict": family.verdict, "reason": family.reason} if family else {"verdict": "exact"}}
    if absorbing:
        n = max(len(residuals), 1)
        mean = {p: [round(sum(r[p][j] for r in residuals.values()) / n, 6) for j in (0, 1)] for p in "qkv"}
        out["absorption"] = {
            "method": ("least-squares linear fit on the calibration activations, its ridge chosen on rows it did not "
                       "read") if absorb else
                      "none (dropped: a measurement baseline)",
            "terms": [t for t, on in (("q/k/v biases", family.biases), ("q/k norms", family.qk_norm)) if on],
            "relative_residual": {p: mean[p][0 if absorb else 1] for p in "qkv"},
            "relative_residual_dropped": {p: mean[p][1] for p in "qkv"},
            "runtimes": "transformers, vLLM and llama.cpp compute the same plain projections (no bias, no q/k norm "
                        "is written)"}
    return out


def _mla_record(shape: Shape, kept: list[int], stride: int, theta: float, share: float,
                losses: dict[int, tuple[float, float]], query_samples: int) -> dict:
    """surgery.json's `mla` fields: the sizes, the kept frequencies and the mean losses of the two fits."""
    n = max(len(losses), 1)
    return {"kv_lora_rank": shape.rank, "full_rank": shape.full_rank, "qk_rope_head_dim": shape.rope_dim,
            "rope_frequencies": kept, "rope_stride": stride, "rope_theta": theta, "rope_kept_share": round(share, 5),
            "rope_key": "RoRoPE: per kept frequency, the K/V heads' principal complex direction (weighted by their "
                        "queries' energy); the residual keys lose their rotation",
            "latent": "joint K-nope/V factorisation weighted by the calibration activations, key rows by their "
                      "queries' and value rows by o_proj's metric",
            "query_refit": {"samples": query_samples} if query_samples else False,
            "output_refit": True, "targets": "local (each layer on the converted layers' outputs)",
            "kv_a_layernorm": f"linear regime: latent mean square ~1e-4 x eps {LATENT_EPS}",
            "rope_loss": round(sum(v[0] for v in losses.values()) / n, 6),
            "latent_loss": round(sum(v[1] for v in losses.values()) / n, 6)}


def _record(shape: Shape, spec, text, dev, seed, calib_seconds, precision: str = "fp32") -> dict:
    """surgery.json's converter fields beside `mla`."""
    return {"architecture": {"spec": spec.name, "target_model_type": "deepseek_v3"},
            "heads": shape.heads, "head_dim": shape.head_dim, "kv_heads": {"before": shape.kv_heads},
            "calibration": text.record() | {"device": str(dev), "precision": precision,
                                            "seconds": round(calib_seconds, 3),
                                            "streaming": "layer by layer from the checkpoint (float32)"},
            "seed": seed}


def convert_to_mla(src: Source, out: Path, options: "MLAOptions", progress: bool = True, *, absorb: bool = True,
                   refit_queries: bool = True) -> dict:
    """Convert `src` into a DeepSeek-V3 (MLA) checkpoint at `out` with latent rank `options.kv_rank` and
    `options.rope_dim` rotary dims per head (default: head_dim); `options` is the kind's options model
    (surgery/mla/options.py), validated where it was built: this checks only what needs the source's config.
    Calibration runs in chunks of `calib_chunk` windows (default: the rule of surgery/calibration/chunks.py), with
    `query_samples` positions per window for the query refit; its forward passes compute in `precision`
    (surgery/precision.py), its statistics in float32/64. Measurement baselines: `absorb` False drops an approximate
    family's biases and q/k norms instead of absorbing them (surgery/mla/absorb.py; the refits still fit the
    source's own logits and outputs); `refit_queries` False runs no query refit. A fraction
    `options.calib_retrieval_mix` of the calibration windows are retrieval examples (from the seed), on which every
    layer's query heads are scored (and the factorisation and query refit weighted, with `retrieval_weight` and
    `retrieval_rows_weight`: surgery/mla/retrieval.py)."""
    o = options
    kv_rank, rope_dim, seed = o.kv_rank, o.rope_dim, o.seed
    query_samples = o.query_samples if refit_queries else 0
    writing = o.write_kwargs()
    dtype, force, max_shard_bytes = writing["dtype"], writing["force"], writing["max_shard_bytes"]
    start = time.time()
    config = src.config
    spec = spec_for(config, KIND, REFUSES)
    family = mla_family(spec.name)
    refuse_config(config, family)
    if spec.fused and spec.qkv_layout(config).value != "fused":
        raise SurgeryError(f"mla reads fused q/k/v rows [q | k | v] only, not {spec.qkv_layout(config).value}")
    shape = Shape(spec, config, kv_rank, rope_dim)
    check_output_path(out, force, source=src.folder)
    dev = pick_device(o.device)
    resolved = resolve_precision(o.precision, dev)
    reader = CheckpointReader(src.folder, allow_pickle=o.allow_pickle)
    bias_names: dict[tuple[int, str], str] = {}
    names = _projection_names(reader, spec, shape.layers, family, bias_names)
    norm_names = _qk_norm_names(reader, spec, config) if family is not None and family.qk_norm else {}
    written = dtype or str(reader.tensors[names[(0, spec.query_projection)]].dtype).removeprefix("torch.")
    if written == "float16":
        raise SurgeryError("mla keeps kv_a_layernorm linear with a latent ~1e-5 (weights ~1e-7), below float16's "
                           "normal range: write --dtype bfloat16 or float32")
    fold = BodyFold.of(family, config, reader.tensors[names[(0, spec.query_projection)]].dtype, LATENT_EPS)
    scaling = fold.attention_scale or shape.head_dim ** -0.5  # Granite's attention_multiplier is its softmax scale

    def read_layer(i: int) -> SourceAttention:
        if spec.fused:  # rows [q heads | k heads | v heads] (Phi-3's qkv_proj)
            qkv = reader.load(names[(i, spec.qkv)]).to(dev, torch.float64)
            q, k, v = qkv.split([shape.heads * shape.head_dim] + [shape.kv_heads * shape.head_dim] * 2)
            o = reader.load(names[(i, spec.o)]).to(dev, torch.float64)
            return SourceAttention(q, k, v, o, shape.heads, shape.kv_heads, shape.head_dim)
        q, k, v, o = (reader.load(names[(i, p)]).to(dev, torch.float64) for p in (spec.q, spec.k, spec.v, spec.o))
        return SourceAttention(q, k, v, o, shape.heads, shape.kv_heads, shape.head_dim)

    def read_projections(i: int) -> SourceProjections:
        def load(name):
            return None if name is None else reader.load(name).to(dev, torch.float64)

        parts = dict(zip("qkv", (spec.q, spec.k, spec.v)))
        return SourceProjections({p: load(names[(i, proj)]) for p, proj in parts.items()},
                                 {p: load(bias_names.get((i, proj))) for p, proj in parts.items()},
                                 {p: load(norm_names.get((i, p))) for p in "qk"},
                                 float(config.get("rms_norm_eps") or 1e-6), shape.head_dim)

    absorbing = family is not None and family.absorbs and bool(bias_names or norm_names)
    moments: dict[int, AbsorptionMoments] = {}
    residuals: dict[int, dict[str, tuple[float, float]]] = {}
    ridges: dict[int, dict[str, float | None]] = {}

    def observer(i: int):
        if not absorbing:
            return None
        moments[i] = AbsorptionMoments(read_projections(i))
        return moments[i]

    rotates = rotating_layers(family, config, shape.layers)
    inv_freq = source_frequencies(src.folder, shape.rotary_dims)
    strides = rope_strides(inv_freq, shape.rope_dim, source_theta(config))
    text = calibration_text(o.calib, load_tokenizer(src), o.calib_tokens, context_of(config), window=o.calib_window,
                            chat_template=o.chat_template, retrieval_mix=o.calib_retrieval_mix, seed=seed)
    chunk = chunk_windows(config, int(text.windows.shape[1]), requested=o.calib_chunk)
    out_dtype = getattr(torch, dtype) if dtype else None
    losses: dict[int, tuple[float, float]] = {}
    fields = ("q_proj", "kv_a", "kv_a_norm", "kv_b", "o_proj")
    with LayerStore(out) as store, calibrating(resolved, dev):
        calib_start = time.time()
        scores = None
        if len(strides) > 1:  # a choice to make: score the frequencies on the source's own stream
            scores = frequency_scores_pass(src.folder, reader, spec, text.windows, dev, read_layer,
                                           spec.rotary_pairs, chunk_windows=chunk, progress=progress, store=store)
            scores = [s for i, s in enumerate(scores) if rotates[i]] or None  # layers without RoPE choose nothing
        kept, stride, theta, share = choose_frequencies(scores, strides, shape.rope_dim, inv_freq,
                                                        int(text.windows.shape[1]))

        def build(i: int, sigma: torch.Tensor, fit: FitWeights | None = None) -> MLAWeights:
            # on the calibration device (float64; priced there by the dry run), where the layer's passes use it
            source = read_layer(i)
            if i in moments:
                fitted, residuals[i], ridges[i] = moments.pop(i).fit()
                if absorb:
                    source.q, source.k, source.v = fitted["q"], fitted["k"], fitted["v"]
            w = mla_layer(source, sigma, kept if rotates[i] else [], spec.rotary_pairs, shape.rank, scaling,
                          LATENT_EPS, rope_dim=shape.rope_dim, weights=fit)
            losses[i] = (w.rope_loss, w.latent_loss)
            return w

        def keep(i: int, w: MLAWeights) -> None:
            store.put(i, {f: getattr(w, f).float() for f in fields})

        retrieval = (RetrievalCalibration(text.retrieval, chunk, o.retrieval_weight, o.retrieval_rows_weight)
                     if text.retrieval else None)
        geometry = MLAGeometry(shape.heads, shape.head_dim, shape.rope_dim, shape.head_dim, theta, LATENT_EPS)
        convert_pass(src.folder, reader, spec, text.windows, dev, build, geometry, keep, chunk_windows=chunk,
                     refit_q=QueryRefit(samples=query_samples) if query_samples else None, seed=seed,
                     progress=progress, store=store, observer=observer, retrieval=retrieval)
        calib_seconds = time.time() - calib_start

        def layer_weights(i: int) -> MLAWeights:
            t = store.get(i)
            return MLAWeights(*(t[f].double() for f in fields), 0.0, 0.0)

        planner = Planner(reader, spec, shape, layer_weights, out_dtype, config, fold)
        new_config = target_config(config, shape, theta, dtype)
        if fold.hidden_act:  # the MLP rewritten as a gated one (Arcee's relu^2 = relu(up x) * (up x))
            new_config["hidden_act"] = fold.hidden_act

        mla = _mla_record(shape, kept, stride, theta, share, losses, query_samples)
        mla["source_rms_norm_eps"] = config.get("rms_norm_eps")
        if retrieval is not None:  # --calib-retrieval-mix: each layer's query heads scored on its examples
            mla["retrieval_heads"] = retrieval.record()
        mla |= _family_record(family, absorbing, absorb, residuals)
        if absorbing and absorb:  # per projection, each layer's ridge (null: the plain fold won on held-out rows)
            mla["absorption"]["ridges"] = {p: [ridges[i][p] for i in sorted(ridges)] for p in "qkv"}
        if not all(rotates):
            mla["layers_without_rope"] = [i for i, r in enumerate(rotates) if not r]
        if fold != BodyFold():
            mla["folded"] = dataclasses.asdict(fold)  # the family's constants, in the weights they scale
        record = _record(shape, spec, text, dev, seed, calib_seconds, resolved)
        record["calibration"]["chunk_windows"] = chunk
        return write_conversion(src, reader, out, planner.plan(), new_config, KIND, record | {"mla": mla}, dtype=dtype,
                                start=start, force=force, progress=progress, max_shard_bytes=max_shard_bytes)
