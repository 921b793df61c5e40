"""Architecture specs as data: one entry per family answers every structural question every kind of surgery asks.

A spec answers, from `config.json` and tensor names alone (no model is built):
- where attention lives: the layer container (`model.layers.N`), the attention module inside a layer (`self_attn`),
  its projections (q/k/v/o, or one fused q/k/v tensor) and the module path prefix old checkpoints lack;
- how query, key and value heads are laid out in a fused tensor, as a function of the config (`layout_rules`);
- which tensors are Conv1D (stored (in, out)) and which are buffers to drop;
- which config keys hold the head counts, and how the MQA/GQA target config is rewritten;
- where q/k norms sit and over what (each head's dims with one shared weight, each head with its own weight, or
  the whole projection);
- what the family does that some kinds cannot carry over (`features`: `Feature`s, each in the family's own words).

Which features a kind refuses, and how it words the refusal, is the kind's (its package's refusals.py, which its
converter passes to `spec_for`; surgery.kinds looks a support label's table up for everyone else): a spec states
facts and never names a kind, and this module holds no table a registry fills, so it answers the same whatever was
imported before it. A family with a Llama-like layout is one entry: `register(ArchSpec("mytype"))`; every kind
reads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from .checkpoint import validate
from .errors import SurgeryError
from .model_types import source_model_type


class QKVLayout(str, Enum):
    SEPARATE = "separate"  # q_proj, k_proj, v_proj: rows are [heads, head_dim]
    FUSED = "fused"  # one tensor, rows [q heads | k heads | v heads]
    INTERLEAVED = "interleaved"  # one tensor, rows [head, (q, k, v), head_dim] (GPT-NeoX, GPTBigCode MHA)
    GROUPED = "grouped"  # one tensor, rows [kv head, (its q heads..., k, v), head_dim] (Falcon's new architecture)


class QKNorm(str, Enum):
    NONE = "none"
    HEAD_DIM = "per head, one weight shared by all heads"  # Qwen3, Gemma3: RMSNorm(head_dim)
    PER_HEAD = "per head, each head its own weight"  # Cohere's use_qk_norm: LayerNorm((heads, head_dim))
    WHOLE = "over the whole projection"  # OLMo2, OLMoE: RMSNorm(heads * head_dim)


class Feature(str, Enum):
    """What a family does that some kinds cannot carry over. A kind that refuses several of a family's features gives
    the reason of the first, in this order."""

    BODY = "parts outside attention that are not Llama's (norms, MLP, embeddings, their multipliers)"
    ENCODER = "an encoder"
    OWN_ATTENTION = "computes attention itself, not through transformers' attention interface"
    TARGET_LACKS = "a setting the MQA/GQA target architecture has no equivalent of"
    CLIP_QKV = "clamps the q/k/v projections' outputs (clip_qkv)"
    WHOLE_QK_NORM = "a q/k norm over the whole projection"
    NORM_MODULE_PER_HEAD = "per-head q/k norms stored as one norm module per head"
    PER_HEAD_QK_NORM = "per-head q/k norms, each head its own weight"
    NO_LAYER_TYPES = "no per-layer attention types (layer_types) in its transformers class or a sibling's"
    POSITIONS_BY_LAYER_TYPE = "positions that depend on a layer's attention type"


@dataclass(frozen=True)
class Trait:
    """One feature of one family: the family's own words for it (`detail`, what a kind's refusal quotes) and the
    config key that turns it on (`switch`; None: always on)."""

    feature: Feature
    detail: str = ""
    switch: str | None = None

    def on(self, config: dict | None) -> bool:
        """Whether the family has this feature: always, or (`switch`) when the config sets that key."""
        return self.switch is None or (config is not None and bool(config.get(self.switch)))


# A refusal table (what a support label, a column of `surgery convert --list`, refuses): feature -> its one-line
# reason, a template over the family's words ("{detail}"), or a function (spec, trait) -> reason, None where that
# family's feature is carried over. The kinds own them (surgery.kinds.refusals).
Refusals = dict[Feature, object]
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "electra")
# What a kind that cannot convert an encoder says instead (the kinds whose outputs carry no modeling code of their own):
# only a conversion that ships its modeling code with the checkpoint converts one.
ENCODERS_NEED_CODE = "encoders need modeling code that travels with the checkpoint: use --to talking-heads"
_WHOLE_NORM = "q/k norms over the whole projection couple all heads (one RMS over every K head)"


@dataclass(frozen=True)
class ArchSpec:
    """How one family of `model_type`s stores its attention. The defaults describe Llama."""

    name: str
    model_types: tuple[str, ...] = ()  # empty: (name,)
    layout: QKVLayout = QKVLayout.SEPARATE
    # (config key, value, layout): the first rule whose key has that value picks the layout of the fused tensor
    layout_rules: tuple[tuple[str, object, QKVLayout], ...] = ()
    layers_path: str = "layers"  # the layer container, a regex over module names (`h`, `encoder.layer`)
    attention: str = "self_attn"  # the self-attention module inside one layer
    q: str | None = "q_proj"  # projections, inside the attention module
    k: str | None = "k_proj"
    v: str | None = "v_proj"
    o: str | None = "o_proj"
    qkv: str = "qkv_proj"  # the fused tensor's projection (non-SEPARATE layouts)
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = "num_key_value_heads"  # None: the architecture has no such config key
    hidden_key: str = "hidden_size"
    layers_key: str = "num_hidden_layers"
    head_dim_key: str | None = "head_dim"
    conv1d: bool = False  # every Linear-like weight is a Conv1D stored (in, out) (GPT-2)
    prefix: str = ""  # module path prefix the in-memory model has and old checkpoints lack (GPT-2: "transformer.")
    drop_pattern: str | None = None  # tensors that are buffers, not weights, in some old checkpoints
    qk_norm: QKNorm = QKNorm.NONE
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")
    qk_norm_switch: str | None = None  # config key that turns the q/k norms on (None: always there)
    # MQA/GQA target when there is no K/V head key: the flag that stores one K/V head (GPTBigCode's multi_query),
    # or nothing, and the K/V heads are stored repeated once per query head (GPT-NeoX)
    mqa_flag: str | None = None
    # the target of MQA/GQA, when it is another architecture (GPT-2 -> GPTBigCode): model_type, architectures and
    # config keys kept
    target_model_type: str | None = None
    target_architectures: tuple[str, ...] = ()
    target_keys: tuple[str, ...] = ()
    # features some kinds cannot carry over, beyond those the fields below imply (`features`)
    traits: tuple[Trait, ...] = ()
    rotary: bool = True  # positions rotate queries and keys (RoPE)
    rotary_pairs: str = "half"  # dims a rotation pairs: (i, i + rot/2) ("half") or (2i, 2i + 1) ("interleaved")
    encoder: bool = False
    # why the parts outside attention (norms, MLP, embeddings) are not Llama's (RMSNorm w * x / rms, gated MLP
    # down(act(gate) * up), plain embedding and untied-or-tied head); None: they are, and a kind that rebuilds them
    # (Feature.BODY) may
    body: str | None = None
    notes: str = ""

    def __post_init__(self):
        if not self.model_types:
            object.__setattr__(self, "model_types", (self.name,))

    # --- tensor names ----------------------------------------------------------------------------------------
    @property
    def fused(self) -> bool:
        """One tensor holds q, k and v (whatever its layout)."""
        return self.layout != QKVLayout.SEPARATE or bool(self.layout_rules)

    @property
    def projections(self) -> tuple[str, ...]:
        if not self.fused:
            return tuple(p for p in (self.q, self.k, self.v, self.o) if p)
        return tuple(p for p in (self.qkv, self.o) if p)

    @property
    def query_projection(self) -> str:
        """The projection that holds the queries (q, or the fused q/k/v)."""
        return self.qkv if self.fused else self.q

    @cached_property
    def attention_pattern(self) -> str:
        """Regex over tensor names: groups "module" (the attention module), "layer", "proj" and "param"."""
        procs = "|".join(re.escape(p) for p in self.projections)
        return (rf"(?P<module>(?:.*\.)?(?P<layers>{self.layers_path})\.(?P<layer>\d+)\.{re.escape(self.attention)})"
                rf"\.(?P<proj>{procs})\.(?P<param>weight|bias)$")

    @cached_property
    def _regex(self) -> re.Pattern:
        return re.compile(self.attention_pattern)

    def match(self, name: str) -> tuple[int, str, str] | None:
        """(layer, projection, 'weight'|'bias') for an attention projection tensor, else None."""
        m = self._regex.search(name)
        return (int(m.group("layer")), m.group("proj"), m.group("param")) if m else None

    def locate(self, name: str) -> tuple[str, int, str, str] | None:
        """(attention module, layer, projection, param) for an attention projection tensor, else None."""
        m = self._regex.search(name)
        return (m.group("module"), int(m.group("layer")), m.group("proj"), m.group("param")) if m else None

    def layer_path(self, name: str) -> str | None:
        """The decoder layer's module path (e.g. `model.layers.3`) of an attention tensor or module name."""
        m = re.search(rf"^(.*?(?:^|\.)(?:{self.layers_path})\.\d+)\.{re.escape(self.attention)}(?:\.|$)", name)
        return m.group(1) if m else None

    @property
    def conv1d_pattern(self) -> str | None:
        """Conv1D weights stored (in, out) that a Linear-based target stores (out, in)."""
        return r"(?:^|\.)h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$" if self.conv1d else None

    def norm_pattern(self, which: str) -> str:
        """Regex over tensor names for the q (`which`="q") or k norm's parameters; group "module", "layer"."""
        name = self.qk_norm_names[0 if which == "q" else 1]
        return (rf"(?P<module>(?:.*\.)?(?:{self.layers_path})\.(?P<layer>\d+)\.{re.escape(self.attention)})"
                rf"\.{re.escape(name)}\.(?P<param>weight|bias)$")

    def out_name(self, name: str) -> str:
        """The name a tensor has in the in-memory model (old checkpoints lack the prefix)."""
        if self.prefix and not name.startswith((self.prefix, "lm_head.")):
            return self.prefix + name
        return name

    # --- reading config.json --------------------------------------------------------------------------------
    @staticmethod
    def count(config: dict, key: str) -> int:
        """An integer config value the architecture needs; a missing one is one clear error."""
        if config.get(key) is None:
            raise SurgeryError(f"config.json has no {key}")
        return int(config[key])

    def heads(self, config: dict) -> int:
        return self.count(config, self.heads_key)

    def kv_heads(self, config: dict) -> int:
        if self.mqa_flag and self.qkv_layout(config) == QKVLayout.FUSED and self.flag(config, self.mqa_flag):
            return 1
        if self.kv_heads_key and config.get(self.kv_heads_key) is not None:
            return int(config[self.kv_heads_key])
        return self.heads(config)

    def head_dim(self, config: dict) -> int:
        if self.head_dim_key and config.get(self.head_dim_key):
            return int(config[self.head_dim_key])
        return self.hidden(config) // self.heads(config)

    def hidden(self, config: dict) -> int:
        return self.count(config, self.hidden_key)

    def layers(self, config: dict) -> int:
        return self.count(config, self.layers_key)

    def flag(self, config: dict, key: str):
        """A config value, with transformers' default for this family when config.json leaves it out."""
        return config.get(key, _DEFAULTS.get((self.name, key)))

    def qkv_layout(self, config: dict) -> QKVLayout:
        for key, value, layout in self.layout_rules:
            if self.flag(config, key) == value:
                return layout
        return self.layout

    def has_qk_norm(self, config: dict) -> bool:
        return self.qk_norm != QKNorm.NONE and (self.qk_norm_switch is None or bool(config.get(self.qk_norm_switch)))

    @property
    def features(self) -> tuple[Trait, ...]:
        """Everything the family does that some kinds cannot carry over, in `Feature` order: what its body, encoder
        and q/k norm fields imply, and its other `traits`."""
        implied = [Trait(Feature.BODY, self.body)] if self.body else []
        if self.encoder:
            implied.append(Trait(Feature.ENCODER, "an encoder"))
        if self.name not in SLIDING_WINDOW_TARGETS | POSITIONS_BY_LAYER_TYPE and not self.encoder:
            implied.append(Trait(Feature.NO_LAYER_TYPES, f"transformers' {self.name} has no per-layer "
                                 "attention types (layer_types)"))
        if self.name in POSITIONS_BY_LAYER_TYPE:
            implied.append(Trait(Feature.POSITIONS_BY_LAYER_TYPE, POSITIONS_BY_LAYER_TYPE[self.name]))
        if self.qk_norm == QKNorm.WHOLE:
            implied.append(Trait(Feature.WHOLE_QK_NORM, _WHOLE_NORM, self.qk_norm_switch))
        elif self.qk_norm == QKNorm.PER_HEAD:
            implied.append(Trait(Feature.PER_HEAD_QK_NORM, self.qk_norm_switch or self.name, self.qk_norm_switch))
        order = list(Feature)
        return tuple(sorted((*implied, *self.traits), key=lambda t: order.index(t.feature)))

    def refused_trait(self, kind: str, config: dict | None, refuses: Refusals) -> tuple[Trait, str] | None:
        """The first feature (with this config) that the kind's support label `kind` refuses (its table `refuses`),
        and its reason."""
        for trait in self.features:
            if trait.feature in refuses and trait.on(config):
                rule = refuses[trait.feature]
                reason = rule(self, trait) if callable(rule) else rule.format(detail=trait.detail)
                if reason is not None:
                    return trait, reason
        return None

    def refusal(self, kind: str, config: dict | None, refuses: Refusals) -> str | None:
        """Why `kind` (a support label, refusing what its table `refuses` says) cannot convert this family (with this
        config), in one line; None when it can. Without a config, only the features the family always has count."""
        refused = self.refused_trait(kind, config, refuses)
        return refused[1] if refused else None


# Config defaults that decide a layout when config.json leaves the key out (transformers' own defaults).
_DEFAULTS = {("gpt_bigcode", "multi_query"): True, ("falcon", "multi_query"): True,
             ("falcon", "new_decoder_architecture"): False}

SPECS: list[ArchSpec] = [
    ArchSpec("llama", notes="q/k/v/o_proj per layer"),
    ArchSpec("mistral"),
    ArchSpec("ministral"),
    ArchSpec("mixtral", body="sparse-MoE MLP with its own router (not DeepSeek's)",
             notes="MoE MLP; attention as Llama"),
    ArchSpec("qwen2", body="q/k/v biases (DeepSeek-V3's q_proj has none)", notes="q/k/v biases"),
    ArchSpec("qwen2_moe", body="q/k/v biases and a sparse-MoE MLP", notes="q/k/v biases, MoE MLP"),
    ArchSpec("qwen3", body="per-head q/k norms (DeepSeek-V3 has none)",
             qk_norm=QKNorm.HEAD_DIM, notes="q/k norms act per head_dim and are shared by all heads, "
             "so they carry over unchanged"),
    ArchSpec("qwen3_moe", body="per-head q/k norms and a sparse-MoE MLP", qk_norm=QKNorm.HEAD_DIM),
    ArchSpec("gemma", body="(1 + w) RMSNorms and an embedding multiplier"),
    ArchSpec("gemma2", body="(1 + w) RMSNorms, post-norms, an embedding multiplier and logit softcaps",
             notes="logit softcap, sliding-window layers"),
    ArchSpec("gemma3_text", body="(1 + w) RMSNorms, post-norms and an embedding multiplier",
             qk_norm=QKNorm.HEAD_DIM, notes="sliding and global layers, per-head q/k norms"),
    ArchSpec("olmo", body="LayerNorm without weights", traits=(Trait(Feature.CLIP_QKV, "OLMo's clip_qkv clamps v_proj", "clip_qkv"),)),
    ArchSpec("olmo2", body="norms after attention and MLP, and q/k norms",
             qk_norm=QKNorm.WHOLE,
             notes="q/k norms over the whole projection: mean pooling averages the K norm's weight over each group"),
    ArchSpec("olmoe", body="q/k norms and a sparse-MoE MLP",
             qk_norm=QKNorm.WHOLE),
    ArchSpec("smollm3", body="layers without RoPE (no_rope_layers)", notes="some layers without RoPE (no_rope_layers)"),
    ArchSpec("phi", body="LayerNorm and a parallel, ungated MLP",
             o="dense", qk_norm=QKNorm.HEAD_DIM, qk_norm_names=("q_layernorm", "k_layernorm"),
             qk_norm_switch="qk_layernorm", notes="partial rotary, biases, output projection `dense`"),
    ArchSpec("stablelm", body="LayerNorm", qk_norm=QKNorm.PER_HEAD, qk_norm_names=("q_layernorm", "k_layernorm"),
             qk_norm_switch="qk_layernorm",
             traits=(Trait(Feature.NORM_MODULE_PER_HEAD, "StableLM qk_layernorm", "qk_layernorm"),),
             notes="partial rotary"),
    ArchSpec("starcoder2", body="LayerNorm and an ungated MLP", notes="biases on q/k/v/o"),
    ArchSpec("granite", body="embedding, residual and logit multipliers",
             notes="attention_multiplier is the softmax scale; embedding/residual/logit multipliers "
             "sit outside attention"),
    ArchSpec("cohere", body="LayerNorm, a parallel block and a logit scale",
             qk_norm=QKNorm.PER_HEAD, rotary_pairs="interleaved", qk_norm_switch="use_qk_norm",
             notes="interleaved rotary; with use_qk_norm, mean pooling averages the K norm's per-head weights (the "
             "aligned merge groups heads by similarity and reorders query heads, which per-head norms cannot follow)"),
    ArchSpec("cohere2", body="LayerNorm, a parallel block and sliding-window layers",
             rotary_pairs="interleaved", notes="RoPE only on sliding-window layers"),
    ArchSpec("helium", body="not verified against DeepSeek-V3's layer", rotary_pairs="interleaved",
             notes="interleaved rotary (its apply_rotary_pos_emb pairs (2i, 2i+1))"),
    ArchSpec("glm", body="partial rotary and a fused gate/up MLP",
             rotary_pairs="interleaved", notes="partial, interleaved rotary"),
    ArchSpec("exaone4", body="norms after attention and MLP, and q/k norms",
             qk_norm=QKNorm.HEAD_DIM, notes="global layers without RoPE when sliding windows are used"),
    ArchSpec("arcee", body="an ungated ReLU^2 MLP"),
    ArchSpec("apertus", body="an ungated xIELU MLP and q/k norms", qk_norm=QKNorm.HEAD_DIM),
    ArchSpec("phi3", body="a fused gate/up MLP and a fused q/k/v projection",
             layout=QKVLayout.FUSED, notes="qkv_proj rows are [q heads | k heads | v heads]"),
    ArchSpec("gpt_neox", body="LayerNorm and a parallel, ungated MLP",
             layout=QKVLayout.INTERLEAVED, attention="attention", qkv="query_key_value", o="dense",
             kv_heads_key=None, head_dim_key=None,
             drop_pattern=r"(?:^|\.)attention\.(bias|masked_bias|rotary_emb\.inv_freq)$",
             notes="transformers' GPTNeoX has no num_key_value_heads: the pooled K/V heads are stored repeated once "
             "per query head, so the output computes grouped-query attention but its KV cache is not smaller."),
    ArchSpec("gpt2", body="LayerNorm, learned positions and an ungated MLP",
             layout=QKVLayout.FUSED, layers_path="h", attention="attn", qkv="c_attn", o="c_proj",
             heads_key="n_head", kv_heads_key=None, hidden_key="n_embd", layers_key="n_layer", head_dim_key=None,
             conv1d=True, prefix="transformer.", rotary=False, drop_pattern=r"(?:^|\.)attn\.(bias|masked_bias)$",
             mqa_flag="multi_query", target_model_type="gpt_bigcode", target_architectures=("GPTBigCodeForCausalLM",),
             target_keys=("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
                          "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range",
                          "scale_attn_weights", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
                          "tie_word_embeddings", "dtype", "torch_dtype"),
             traits=(Trait(Feature.TARGET_LACKS, "GPT-2 with scale_attn_by_inverse_layer_idx has no GPTBigCode "
                           "equivalent", "scale_attn_by_inverse_layer_idx"),),
             notes="converted into GPTBigCode (multi_query=True for MQA), a standard architecture that stores one K/V "
             "head; GPTBigCode has only MQA and MHA, so G must be 1 or the number of heads."),
    ArchSpec("gpt_bigcode", body="LayerNorm, learned positions and an ungated MLP",
             layout=QKVLayout.FUSED, rotary=False, layout_rules=(("multi_query", False, QKVLayout.INTERLEAVED),),
             layers_path="h", attention="attn", qkv="c_attn", o="c_proj", heads_key="n_head", kv_heads_key=None,
             hidden_key="n_embd", layers_key="n_layer", head_dim_key=None, mqa_flag="multi_query",
             notes="multi_query=True stores [q heads | k | v]; multi_query=False stores [head, (q, k, v), head_dim]. "
             "Only MQA and MHA exist, so G must be 1 or the number of heads."),
    ArchSpec("falcon", body="LayerNorm and a parallel, ungated MLP", layout=QKVLayout.INTERLEAVED,
             layout_rules=(("new_decoder_architecture", True, QKVLayout.GROUPED), ("multi_query", True, QKVLayout.FUSED)),
             layers_path="h", attention="self_attention", qkv="query_key_value", o="dense", kv_heads_key="num_kv_heads",
             head_dim_key=None, mqa_flag="multi_query",
             traits=(Trait(Feature.OWN_ATTENTION, "FalconAttention computes attention itself, not through "
                           "transformers' attention interface"),),
             notes="new_decoder_architecture stores [kv head, (q heads, k, v), head_dim] with num_kv_heads; the old "
             "one stores MQA (multi_query) or [head, (q, k, v), head_dim]: there G must be 1 or the number of heads"),
    ArchSpec("bert", body="an encoder",
             layers_path=r"encoder\.layer", attention="attention.self", q="query", k="key", v="value", o=None,
             encoder=True, rotary=False,
             notes="encoder (talking-heads only)"),
]


def register(spec: ArchSpec) -> ArchSpec:
    """Add a family (or replace the one with the same name); every kind picks it up."""
    unregister(spec.name)
    SPECS.append(spec)
    return spec


def unregister(name: str) -> None:
    SPECS[:] = [s for s in SPECS if s.name != name]


def supported_model_types(kind: str | None = None, refuses: Refusals | None = None) -> list[str]:
    """The model_types `kind` (a support label refusing what its table `refuses` says; None: any kind) converts with
    the family's default config."""
    _label_and_table(kind, refuses)
    return sorted(t for s in SPECS for t in s.model_types if kind is None or s.refusal(kind, None, refuses) is None)


def _label_and_table(kind: str | None, refuses: Refusals | None) -> None:
    """A support label comes with its refusal table (surgery.kinds.spec_for looks it up): this module keeps none."""
    if kind is not None and refuses is None:
        raise TypeError(f"{kind!r} without its refusal table: pass `refuses`, or ask surgery.kinds.spec_for")


def find_spec(model_type: str | None) -> ArchSpec | None:
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    return None


# Sliding-window layers as a standard checkpoint (`--to swa`): the model_type that writes per-layer attention types
# (`layer_types` with `sliding_window`) for each family whose layers it can hold unchanged. Llama's body is
# Ministral's (no biases); Qwen2/Qwen3/SmolLM3 also need `use_sliding_window`; Gemma 2 uses one RoPE for both types.
SLIDING_WINDOW_TARGETS = {"llama": "ministral", "mistral": "ministral", "ministral": "ministral", "qwen2": "qwen2",
                          "qwen3": "qwen3", "smollm3": "smollm3", "gemma2": "gemma2"}
# Model types whose `sliding_window` counts only when the config sets `use_sliding_window` (transformers' default: off).
# The one list: what a checkpoint's sliding layers are (surgery.kinds.base.sliding_layers, surgery check) and whether
# swa's output sets the switch (its targets, SLIDING_WINDOW_TARGETS' values, include no MoE type).
SLIDING_WINDOW_SWITCHED = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")
# Families with layer_types whose layers of the two types differ in more than the mask: retyping a layer changes it.
POSITIONS_BY_LAYER_TYPE = {
    "gemma3_text": "Gemma 3's sliding and global layers use different RoPE bases",
    "cohere2": "Cohere 2's global layers have no RoPE",
    "exaone4": "EXAONE 4's global layers have no RoPE when sliding windows are used",
}


def spec_for(config: dict, kind: str | None = None, refuses: Refusals | None = None) -> ArchSpec:
    """The family of `config`, refusing in one line when `kind` (a support label, as the kind's converter names
    itself) cannot convert it, by its table `refuses` (from the kind's own package; surgery.kinds.spec_for looks a
    label's up); None: any family surgery knows."""
    _label_and_table(kind, refuses)
    model_type = config.get("model_type")
    spec = find_spec(model_type)
    if spec is None:
        if kind is None:
            raise SurgeryError(f"unsupported architecture {model_type!r}; supported: "
                               f"{', '.join(supported_model_types())}")
        encoders = refuses.get(Feature.ENCODER)
        hint = f" ({encoders})" if model_type in ENCODER_TYPES and encoders else ""
        raise SurgeryError(f"unsupported architecture {model_type!r} for {kind}{hint}; supported: "
                           f"{', '.join(supported_model_types(kind, refuses))}")
    reason = spec.refusal(kind, config, refuses) if kind is not None else None
    if reason:
        raise SurgeryError(f"{kind} cannot convert {model_type!r}: {reason}; supported: "
                           f"{', '.join(supported_model_types(kind, refuses))}")
    return spec


def qkv_layout(spec: ArchSpec, config: dict) -> QKVLayout:
    return spec.qkv_layout(config)


def _layout_text(spec: ArchSpec) -> str:
    if not spec.fused:
        return "/".join(p for p in (spec.q, spec.k, spec.v, spec.o) if p)
    layouts = [spec.layout.value] + [f"{layout.value} if {key}={value}" for key, value, layout in spec.layout_rules]
    return f"{spec.qkv} ({', '.join(layouts)}) + {spec.o}" + (", Conv1D" if spec.conv1d else "")


def support_table(refusals: dict[str, Refusals], verdicts: dict[str, object]) -> list[dict[str, str]]:
    """One row per model_type: its layout, q/k norm, and for every kind's column (`refusals`: each support label's
    table, surgery.kinds.refusals) "yes" (or the label's verdict, `verdicts`: a function spec -> text) or the one-line
    reason it is refused (with the family's default config; refusals that depend on a config key are listed by
    `conditional_refusals`)."""
    rows = []
    for spec in sorted(SPECS, key=lambda s: s.name):
        for model_type in spec.model_types:
            norm = spec.qk_norm.value + (f" (when {spec.qk_norm_switch})" if spec.qk_norm_switch else "")
            rows.append({"model_type": model_type, "attention": _layout_text(spec), "q/k norm": norm}
                        | {kind: _cell(spec, kind, refusals, verdicts)[1] for kind in refusals})
    return rows


def _cell(spec: ArchSpec, kind: str, refusals: dict[str, Refusals], verdicts: dict[str, object]) -> tuple[bool, str]:
    """(converts, what the support table says): the refusal, or "yes" / the label's verdict."""
    reason = spec.refusal(kind, None, refusals[kind])
    if reason is not None:
        return False, reason
    verdict = verdicts.get(kind)
    return True, verdict(spec) if verdict else "yes"


def conditional_refusals(refusals: dict[str, Refusals]) -> list[str]:
    """Refusals that depend on a config key: per family, per support label (`refusals`: each label's table), the
    first feature it refuses among those a key turns on."""
    lines = []
    for spec in sorted(SPECS, key=lambda s: s.name):
        for kind, refuses in refusals.items():
            refused = spec.refused_trait(kind, {t.switch: True for t in spec.features if t.switch}, refuses)
            if refused and refused[0].switch:
                lines.append(f"{spec.name}: {kind} refused when `{refused[0].switch}` is set ({refused[1]})")
    return lines


def support_markdown(refusals: dict[str, Refusals], verdicts: dict[str, object]) -> str:
    """The families x kinds table (`refusals`, `verdicts`: as support_table takes them), as `surgery convert --list`
    prints it (surgery.kinds.support_markdown) and docs/tasks/convert.md shows it."""
    kinds = tuple(refusals)
    rows = support_table(refusals, verdicts)
    specs = [spec for spec in sorted(SPECS, key=lambda s: s.name) for _ in spec.model_types]
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for spec, row in zip(specs, rows):
        cells = [v if c not in kinds or _cell(spec, c, refusals, verdicts)[0] else "no: " + v for c, v in row.items()]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    counts = ", ".join(f"{kind} {sum(_cell(spec, kind, refusals, verdicts)[0] for spec in specs)}" for kind in kinds)
    lines += ["", f"model_types supported: {counts}."]
    lines += [""] + [f"- {line}" for line in conditional_refusals(refusals)]
    return "\n".join(lines) + "\n"


# ---- the attention shape of any checkpoint ------------------------------------------------------------------------
_KEYS = {
    "heads": ("num_attention_heads", "n_head"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer"),
}
def first_key(config: dict, keys: tuple[str, ...]) -> int:
    """The first of `keys` that `config` sets, as an int (refused in one line when none is set)."""
    for k in keys:
        if config.get(k) is not None:
            return int(config[k])
    raise SurgeryError(f"config.json has no {keys[0]}" + (f" (or {', '.join(keys[1:])})" if keys[1:] else ""))


def attention_shape(config: dict) -> dict:
    """heads, stored K/V heads, head_dim, hidden size, layers — from the family's spec (converted checkpoints: their
    source family's), or from the usual config keys for any other transformer."""
    validate.check_config_counts(config)
    spec = find_spec(source_model_type(str(config.get("model_type"))))
    if spec is not None:
        return {"layers": spec.layers(config), "hidden": spec.hidden(config), "heads": spec.heads(config),
                "kv_heads": spec.kv_heads(config), "head_dim": spec.head_dim(config)}
    heads = first_key(config, _KEYS["heads"])
    hidden = first_key(config, _KEYS["hidden"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {"layers": first_key(config, _KEYS["layers"]), "hidden": hidden, "heads": heads, "kv_heads": kv,
            "head_dim": head_dim}
