"""The source model layer by layer (sequential onloading), for calibration on any device.

The model is built from config.json as a skeleton on the meta device (transformers' own classes, no checkpoint
code; small buffers such as rotary frequencies are computed on the host). The modules outside the decoder layers
(embeddings, final norm) are read from the checkpoint and kept on the device; one pass with every decoder layer
stubbed out records the hidden states entering layer 0 and the arguments each layer receives (masks, rotary
cos/sin). Then each decoder layer in turn is read straight from the checkpoint (`CheckpointReader`: any dtype,
sharded or not), put on the device in float32, handed to the caller, and freed (back to meta) when the caller moves
on. Peak memory: one decoder layer in float32 + the calibration activations + the embedding matrix.

Plain `nn.Embedding` matrices stay in the checkpoint's dtype (their lookups are cast to float32, which is exact);
everything else is float32. The calibration activations stay on the device, or on the host when they would not fit
in the device's free memory (`offload`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from ..errors import SurgeryError
from ..checkpoint.tensors import CheckpointReader, dtype_size
from ..precision import calibration_autocast
from ..progress import Progress
from .chunks import EAGER_WINDOWS, chunk_terms_per_token, chunk_tokens, windows_within
from .layout import memory_layout
from .residual import ResidualChunks, SpillPolicy, default_budget

__all__ = ["LayerCall", "LayerStream", "estimate_peak_bytes", "open_stream", "run_layer",
           "LayerProgress", "StopForward", "run_until_stopped"]

OFFLOAD_FRACTION = 0.5  # activations may take at most this share of the device's free memory
RUNTIME_BYTES = 400 << 20  # the process before any tensor: Python, torch, transformers (measured: 389 MiB RSS)
# a process that runs on CUDA also holds the CUDA context and the kernels of the libraries it loads in host memory:
# the H100 run's calibrated conversions (torch 2.11+cu130) peaked 0.3-1.2 GB above the terms below, never more
CUDA_RUNTIME_BYTES = 1280 << 20


@dataclass
class LayerCall:
    """How the model called one decoder layer on one chunk: the extra positional and keyword arguments."""

    args: tuple
    kwargs: dict


def first_output(out):
    """A module's output tensor: the first element when it returns a tuple (a decoder layer, an attention)."""
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def run_layer(layer: nn.Module, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """One decoder layer's output, computed in the running conversion's precision (surgery.precision.calibrating)."""
    with calibration_autocast():
        return first_output(layer(hidden, *call.args, **call.kwargs))


class StopForward(Exception):
    """Raised by a hook to end a forward pass once it has what it needs (the rest would compute unread outputs)."""


def run_until_stopped(forward: Callable, *args, **kwargs) -> bool:
    """Call `forward`; True when a hook ended it early with `StopForward`, False when it ran to the end."""
    try:
        forward(*args, **kwargs)
    except StopForward:
        return True
    return False


def decoder_layers(model: nn.Module, count: int) -> tuple[list[str], list[nn.Module]]:
    """Module paths and modules of the decoder layers: the model's ModuleList of `count` modules."""
    base = model.base_model
    prefix = model.base_model_prefix
    for name, module in base.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and count > 0:
            full = f"{prefix}.{name}" if prefix and base is not model else name
            return [f"{full}.{i}" for i in range(count)], list(module)
    raise SurgeryError(f"cannot find the {count} decoder layers of {type(model).__name__}")


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    if leaf in target._parameters:
        target._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        target._buffers[leaf] = value


class LayerStream:
    """A causal LM whose decoder layers are materialised one at a time on `device` (see the module docstring).

    `load(i)` / `free(i)` put layer i's weights on the device and take them away again; the resident variant
    (a model already in memory) passes no-ops."""

    def __init__(self, model: nn.Module, paths: list[str], layers: list[nn.Module], device: torch.device,
                 load: Callable[[int], None] | None = None, free: Callable[[int], None] | None = None,
                 offload: bool = False):
        self.model, self.paths, self.modules, self.device = model, paths, layers, device
        self._load, self._free = load, free
        self.offload = offload
        self.spill = SpillPolicy()  # residual streams in memory, unless `spill_into` names a folder

    def spill_into(self, folder: Path | None, beside: Path, budget: int | None = None) -> None:
        """Residual-stream chunks past `budget` bytes of host memory (default: `residual.default_budget()`) go to
        files in `folder` (a temporary folder the caller removes: the layer store's; None: memory); `beside` is the
        output."""
        self.spill = SpillPolicy(folder, budget, beside)

    def release_embeddings(self) -> None:
        """Free the modules outside the decoder layers (embeddings, final norm) once the embedding step is done: the
        layer loop never uses them again. A stream over a model already in memory keeps them."""
        release = getattr(self, "_release", None)
        if release:
            release()

    @property
    def config(self):
        return self.model.config

    def __len__(self) -> int:
        return len(self.modules)

    # --- activations ---------------------------------------------------------------------------------------
    def stash(self, t: torch.Tensor) -> torch.Tensor:
        """Keep an activation between layers: on the device, or on the host when offloading."""
        if self.offload and t.device.type != "cpu":
            return t.to("cpu", non_blocking=False)
        return t

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True) if t.device != self.device else t

    def plan_offload(self, tokens: int, streams: int = 4) -> None:
        """Offload the activations when `streams` copies of [tokens, hidden] float32 would not fit on the device."""
        if self.device.type != "cuda":
            return
        hidden = int(getattr(self.config, "hidden_size", 0) or 0)
        free, _ = torch.cuda.mem_get_info(self.device)
        self.offload = streams * tokens * hidden * 4 > OFFLOAD_FRACTION * free

    # --- the embedding step --------------------------------------------------------------------------------
    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[LayerCall]]:
        """Hidden states entering layer 0 for `input_ids` [b, L], and every layer's call arguments."""
        calls: list[LayerCall | None] = [None] * len(self.modules)
        first: list[torch.Tensor] = []

        def stub(i):
            def forward(*args, **kwargs):
                hidden = args[0] if args else kwargs.pop("hidden_states")
                if i == 0:
                    first.append(hidden)
                calls[i] = LayerCall(tuple(args[1:]), dict(kwargs))
                return hidden

            return forward

        for i, layer in enumerate(self.modules):
            layer.forward = stub(i)
        try:
            with calibration_autocast():
                self.model.base_model(input_ids=input_ids.to(self.device), use_cache=False)
        finally:
            for layer in self.modules:
                del layer.forward  # back to the class's forward
        return first[0], calls  # type: ignore[return-value]

    def embed_chunks(self, chunks: list[torch.Tensor]) -> tuple[ResidualChunks, list[list[LayerCall]]]:
        """The hidden states entering layer 0, chunk by chunk (kept under the stream's spill policy), and the calls."""
        hidden, calls = self.spill.stream(), []
        for c in chunks:
            h, call = self.embed(c)
            hidden.append(self.stash(h.float()))
            calls.append(call)
        return hidden, calls

    # --- the layers ----------------------------------------------------------------------------------------
    def layers(self) -> Iterator[tuple[int, str, nn.Module]]:
        """(index, module path, layer on the device) for every decoder layer in order; each is freed when the
        caller asks for the next one (or stops)."""
        for i, (path, layer) in enumerate(zip(self.paths, self.modules)):
            if self._load:
                self._load(i)
            try:
                yield i, path, layer
            finally:
                if self._free:
                    self._free(i)


# --- building a stream from a checkpoint ---------------------------------------------------------------------
def _skeleton(folder: Path, attn_implementation: str):
    """The causal LM from config.json: parameters on meta, buffers computed on the host. No checkpoint code runs."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # never the checkpoint's code
    except (OSError, ValueError, KeyError) as e:
        raise SurgeryError(f"cannot read the config of {folder} for calibration: {str(e).splitlines()[0]}") from None
    with init_empty_weights(include_buffers=False):
        for impl in (attn_implementation, "eager"):
            try:
                model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
                break
            except (ValueError, ImportError):
                continue
        else:
            raise SurgeryError(f"cannot build {config.model_type} for calibration")
    return model.eval()


def _layer_names(reader: CheckpointReader, container: str) -> dict[int, dict[str, str]]:
    """layer -> {name inside the layer: checkpoint tensor name}, for checkpoint names `...<container>.<i>.<rest>`.

    Mapping by the suffix inside the layer keeps working when the in-memory model prefixes names differently
    from the checkpoint (GPT-2's `transformer.`, a base model saved without its head)."""
    pattern = re.compile(rf"(?:^|\.){re.escape(container)}\.(\d+)\.(.+)$")
    found: dict[int, dict[str, str]] = {}
    for name in reader.names():
        m = pattern.search(name)
        if m:
            found.setdefault(int(m.group(1)), {}).setdefault(m.group(2), name)
    return found


def _resident_name(reader: CheckpointReader, name: str, prefix: str) -> str | None:
    """The checkpoint name of an in-memory tensor outside the layers (with or without the base model's prefix)."""
    if name in reader:
        return name
    bare = name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name
    if bare in reader:
        return bare
    hits = [n for n in reader.names() if n.endswith("." + bare)]
    return hits[0] if len(hits) == 1 else None


def release_memory() -> None:
    """Hand freed host memory back to the system (glibc keeps freed mid-sized blocks otherwise): the host's
    footprint between layers stays at one layer instead of the high-water mark."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _cast_to_float32(module, args, output):
    return output.float()


def open_stream(folder: Path, reader: CheckpointReader, device: torch.device | str = "cpu",
                attn_implementation: str = "sdpa") -> LayerStream:
    """A `LayerStream` over the checkpoint in `folder` (read through `reader`) on `device`."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    model = _skeleton(Path(folder), attn_implementation)
    count = int(model.config.num_hidden_layers)
    paths, layers = decoder_layers(model, count)
    for module in model.modules():  # buffers (rotary frequencies, masks) are small: they live on the device
        for key, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[key] = buf.to(device)
    prefix = model.base_model_prefix
    in_layer = tuple(p + "." for p in paths)
    base_names = {f"{prefix}.{n}" if prefix else n for n, _ in model.base_model.named_parameters()}
    plain_embeddings = {name for name, m in model.named_modules() if type(m) is nn.Embedding}
    for name, param in model.named_parameters():
        if name.startswith(in_layer) or name not in base_names:
            continue
        source = _resident_name(reader, name, prefix)
        if source is None:
            raise SurgeryError(f"the checkpoint lacks {name} (needed for the embedding step)")
        value = reader.load(source)
        if tuple(value.shape) != tuple(param.shape):
            raise SurgeryError(f"tensor {source} of shape {list(value.shape)} does not match config.json "
                               f"({list(param.shape)})")
        owner = name.rpartition(".")[0]
        keep = owner in plain_embeddings and value.is_floating_point()
        _set_tensor(model, name, value.to(device, value.dtype if keep else torch.float32))
    for name in plain_embeddings:
        if not name.startswith(in_layer):
            model.get_submodule(name).register_forward_hook(_cast_to_float32)

    container = paths[0].rsplit(".", 2)[-2]
    names = _layer_names(reader, container)
    shapes = {i: {n: p.shape for n, p in layer.named_parameters()} for i, layer in enumerate(layers)}

    model_type = str(model.config.model_type)

    def load(i: int) -> None:
        layer, known = layers[i], memory_layout(model_type, names.get(i, {}), reader.load)
        for rel, shape in shapes[i].items():
            loader = known.get(rel)
            if loader is None:
                raise SurgeryError(f"the checkpoint lacks {paths[i]}.{rel} (layer {i}); found: "
                                   f"{', '.join(sorted(known)[:6]) or 'nothing for that layer'}")
            value = loader()
            if tuple(value.shape) != tuple(shape):
                raise SurgeryError(f"layer {i}'s {rel} of shape {list(value.shape)} does not match config.json "
                                   f"({list(shape)})")
            _set_tensor(layer, rel, value.to(device, torch.float32))

    def free(i: int) -> None:
        for rel, shape in shapes[i].items():
            _set_tensor(layers[i], rel, torch.empty(shape, dtype=torch.float32, device="meta"))
        if device.type == "cpu":
            release_memory()

    resident = [name for name, _ in model.named_parameters() if not name.startswith(in_layer)]

    def release() -> None:
        for name in resident:
            param = model.get_parameter(name)
            _set_tensor(model, name, torch.empty(param.shape, dtype=param.dtype, device="meta"))

    stream = LayerStream(model, paths, layers, device, load, free)
    stream._release = release
    return stream


def resident_stream(model: nn.Module, device: torch.device | str = "cpu") -> LayerStream:
    """A `LayerStream` over a model already in memory (every layer resident): the reference the streamed path is
    tested against."""
    device = torch.device(device)
    model.to(device)
    paths, layers = decoder_layers(model, int(model.config.num_hidden_layers))
    return LayerStream(model, paths, layers, device)


# --- progress ----------------------------------------------------------------------------------------------
class LayerProgress(Progress):
    """The toolkit's progress (surgery/progress.py) counted in layers: a bar on a terminal; when not, one plain line
    per layer (on stderr) with the seconds so far and the caller's note; nothing when disabled."""

    def __init__(self, desc: str, total: int, enabled: bool = True):
        super().__init__(total, desc, unit="layer", enabled=enabled, every=0)
        self.note = ""

    def update(self, note: str = "") -> None:  # one layer done
        self.note = note
        super().update(1)

    def line(self, now: float | None = None) -> str:
        return f"{self.desc}: layer {self.done}/{self.total} ({time.monotonic() - self.start:.1f} s){self.note}"


# --- the memory model ----------------------------------------------------------------------------------------
def estimate_peak_bytes(config: dict, calib_tokens: int, dtype: str | torch.dtype = "bfloat16", *,
                        eager: bool = False, device: str = "cpu", window: int = 512,
                        chunk_windows: int | None = None, streams: int = 1, budget: int | None = None) -> dict:
    """Peak memory of a streamed calibration, in bytes: {"layer", "embedding", "activations", "scratch",
    "runtime", "device", "host", "spilled"}.

    - layer: the largest decoder layer's parameters in float32 (counted on the meta skeleton of `config`);
    - embedding: the modules outside the layers (plain embedding matrices in the checkpoint's `dtype`, the rest
      in float32);
    - activations: the residual streams (`streams` float32 [tokens, hidden] tensors) up to the spill budget
      (`budget`, default `residual.default_budget()`; the rest, "spilled", goes to disk and is not memory), and one
      chunk's attention inputs, source and converted attention outputs, queries, keys and heads (float32
      [chunk tokens, width]: every per-layer stage works chunk by chunk);
    - scratch: one chunk's attention probabilities and MLP activations.
    A chunk is `chunk_windows` windows of `window` tokens (default: the converters' rule, surgery/calibration/chunks.py).
    On "cpu" everything is host memory; on CUDA the device holds all four and the host about one layer read from
    the checkpoint (in its dtype) plus the embedding being loaded; "host" includes the runtime (Python, torch,
    transformers: `RUNTIME_BYTES`).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
    cfg = AutoConfig.for_model(**config) if not hasattr(config, "to_dict") else config
    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(cfg)
    count = int(model.config.num_hidden_layers)
    paths, layers = decoder_layers(model, count)
    layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    in_layer = tuple(p + "." for p in paths)
    plain = {name for name, m in model.named_modules() if type(m) is nn.Embedding}
    prefix = model.base_model_prefix
    base = {f"{prefix}.{n}" if prefix else n for n, _ in model.base_model.named_parameters()}
    embedding = 0
    for name, p in model.named_parameters():
        if name in base and not name.startswith(in_layer):
            embedding += p.numel() * (dtype_size(dt) if name.rpartition(".")[0] in plain else 4)
    c = model.config
    hidden = int(c.hidden_size)
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    inter = int(getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden)
    tokens = calib_tokens
    per_activations, per_scratch = chunk_terms_per_token(hidden, heads, kv, head_dim, inter, window, eager)
    if chunk_windows is None:  # the converters' rule (surgery/calibration/chunks.py)
        chunk_windows = EAGER_WINDOWS if eager else windows_within(per_activations + per_scratch, window)
    chunk = chunk_tokens(chunk_windows, tokens, window)
    residual = 4 * tokens * hidden * streams
    # the spill budget is host memory: residual chunks on a CUDA device stay there
    resident = min(residual, default_budget() if budget is None else budget) if str(device) == "cpu" else residual
    activations = resident + chunk * per_activations
    scratch = chunk * per_scratch
    layer = 4 * layer_params
    on_device = layer + embedding + activations + scratch
    host_read = layer_params * dtype_size(dt)
    parts = {"layer": layer, "embedding": embedding, "activations": activations, "scratch": scratch,
             "runtime": RUNTIME_BYTES, "spilled": residual - resident}
    if str(device) == "cpu":
        return parts | {"device": 0, "host": RUNTIME_BYTES + on_device + host_read}
    return parts | {"device": on_device, "cuda runtime": CUDA_RUNTIME_BYTES,
                    "host": RUNTIME_BYTES + CUDA_RUNTIME_BYTES + host_read + embedding}
