"""What one decoder layer's attention sees on the calibration tokens (the layers themselves come one at a time from
`surgery.calibration.stream`).

Inside a layer, hooks capture the attention's input (the normalised hidden states entering the q/k/v
projections), the per-head outputs entering o_proj, and, through an attention function registered with
transformers' AttentionInterface, the rotated queries and keys and the softmax scaling the model used.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

from ..precision import calibration_autocast
from .stream import LayerCall, StopForward, first_output, open_stream, run_layer, run_until_stopped

CAPTURE_PREFIX = "surgery_capture_"
_RECORDER: list["AttentionRecord"] = []


@dataclass
class AttentionRecord:
    """What one attention call saw (chunks appended in order)."""

    queries: list[torch.Tensor] = field(default_factory=list)  # [b, H, L, D] rotated
    keys: list[torch.Tensor] = field(default_factory=list)  # [b, KV, L, D] rotated
    scaling: float | None = None
    softcap: float | None = None


def _capture_attention(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        if _RECORDER:
            rec = _RECORDER[-1]
            rec.queries.append(query.detach().float())  # float32 also under bf16 autocast: the fits' inputs
            rec.keys.append(key.detach().float())
            rec.scaling = kwargs.get("scaling")
            rec.softcap = kwargs.get("softcap")
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if base == "eager":
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


def register_capture(base: str) -> str:
    """Register `surgery_capture_<base>` (attention and mask functions) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = CAPTURE_PREFIX + base
    AttentionInterface.register(name, _capture_attention(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


@contextlib.contextmanager
def recording():
    rec = AttentionRecord()
    _RECORDER.append(rec)
    try:
        yield rec
    finally:
        _RECORDER.remove(rec)


def instrument(model):
    """Route `model`'s attention calls through the recording attention function (same math, recorded)."""
    impl = model.config._attn_implementation
    if not impl.startswith(CAPTURE_PREFIX):
        model.config._attn_implementation = register_capture(impl)
    return model.eval()


def open_recorded_stream(folder, reader, device, windows: torch.Tensor, chunk_windows: int, store=None):
    """The source at `folder` streamed layer by layer (surgery.calibration.stream) with its attention calls recorded
    (`instrument`), its embeddings of `windows` [N, L] computed in chunks of `chunk_windows` windows and released:
    (stream, hidden states per chunk, each chunk's layer calls). `store`: a layer store whose folder takes the
    residual stream past its memory budget."""
    stream = open_stream(folder, reader, device, attn_implementation="sdpa")
    instrument(stream.model)
    if store is not None:
        stream.spill_into(store.scratch("residual"), store.beside)
    chunks = list(windows.split(chunk_windows))
    stream.plan_offload(windows.numel(), streams=1)
    hidden, calls = stream.embed_chunks(chunks)
    stream.release_embeddings()
    return stream, hidden, calls


def load_resident_model(folder):
    """The whole source as a float32 causal LM, instrumented: the in-memory reference the layer-streamed merge is
    tested against (conversions stream layer by layer: `surgery.calibration.stream`)."""
    from transformers import AutoModelForCausalLM

    for impl in ("sdpa", "eager"):
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=impl,
                                                         trust_remote_code=False)
            break
        except (ValueError, ImportError):
            continue
    return instrument(model)


@dataclass
class AttentionCall:
    """The attention module's arguments and input, caught on the way in."""

    args: tuple
    kwargs: dict
    x: torch.Tensor  # [b, L, d] the normalised hidden states entering the q/k/v projections


@torch.no_grad()
def attention_input(layer: torch.nn.Module, attention: torch.nn.Module, in_module: torch.nn.Module,
                    hidden: torch.Tensor, call: LayerCall) -> AttentionCall:
    """Run `layer` only up to its q/k/v projection and return what its attention module received."""
    caught: dict = {}

    def on_attention(module, args, kwargs):
        caught["args"], caught["kwargs"] = args, kwargs

    def on_projection(module, args):
        caught["x"] = args[0].float()
        raise StopForward

    handles = [attention.register_forward_pre_hook(on_attention, with_kwargs=True),
               in_module.register_forward_pre_hook(on_projection)]
    try:
        run_until_stopped(run_layer, layer, hidden, call)
    finally:
        for h in handles:
            h.remove()
    return AttentionCall(caught["args"], caught["kwargs"], caught["x"])


@dataclass
class AttentionRun:
    output: torch.Tensor  # [b, L, d] the attention module's output (after o_proj)
    heads: torch.Tensor  # [b, L, H*D] what entered o_proj
    record: AttentionRecord


@torch.no_grad()
def run_attention(attention: torch.nn.Module, out_module: torch.nn.Module, call: AttentionCall) -> AttentionRun:
    """Run the attention module alone on a caught call, recording queries, keys and o_proj's input."""
    heads: list[torch.Tensor] = []
    handle = out_module.register_forward_pre_hook(lambda m, args: heads.append(args[0].float()))
    try:
        with recording() as rec, calibration_autocast():
            out = first_output(attention(*call.args, **call.kwargs)).float()
    finally:
        handle.remove()
    return AttentionRun(out, heads[0], rec)


@torch.no_grad()
def run_layer_recorded(layer: torch.nn.Module, attention: torch.nn.Module, out_module: torch.nn.Module,
                       hidden: torch.Tensor, call: LayerCall) -> tuple[torch.Tensor, AttentionRun]:
    """Run a whole layer, also returning its attention's output, o_proj input and recorded queries/keys."""
    heads: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    h1 = out_module.register_forward_pre_hook(lambda m, args: heads.append(args[0].float()))
    h2 = attention.register_forward_hook(lambda m, args, out: outs.append(first_output(out).float()))
    try:
        with recording() as rec:
            new_hidden = run_layer(layer, hidden, call)
    finally:
        h1.remove()
        h2.remove()
    return new_hidden, AttentionRun(outs[0], heads[0], rec)


@torch.no_grad()
def run_layer_with_attention_output(layer: torch.nn.Module, attention: torch.nn.Module, hidden: torch.Tensor,
                                    call: LayerCall, attention_output: torch.Tensor) -> torch.Tensor:
    """Run `layer` with its attention module answering `attention_output` (already computed) instead of recomputing it."""
    attention.forward = lambda *args, **kwargs: (attention_output, None)
    try:
        return run_layer(layer, hidden, call)
    finally:
        del attention.forward  # back to the class's forward
