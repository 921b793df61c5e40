"""Per-layer diagnostics: where does the conversion hurt?

`check --layers` runs the first windows of the evaluation text (up to `LAYER_TOKENS` tokens) through the source
with forward hooks on every decoder layer and on its attention module, keeping their float32 outputs in a spill
store (memory or scratch disk), then through the converted model with the same hooks, which compare each output
with the source's as it is produced. Both models see the same input ids, so layer 0's attention error is the
surgery's own; later layers add what earlier errors propagated.

For each layer: relative error ||converted - source|| / ||source|| (Frobenius, over all tokens) of the attention
module's output (before the residual add, for pre-norm decoders) and of the hidden state leaving the layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..calibration.stream import first_output
from ..errors import SurgeryError
from .spill import SpillStore

LAYER_TOKENS = 2048
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
KINDS = ("attention", "hidden")


def decoder_layers(model) -> list[nn.Module]:
    """The model's decoder (or encoder) layers: the first ModuleList as long as the config's layer count."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return list(module)
    raise SurgeryError(f"--layers: cannot find the {count} layers of a {type(model).__name__}")


def attention_of(layer: nn.Module) -> nn.Module:
    for name in ATTENTION_NAMES:
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module):
            return child
    raise SurgeryError(f"--layers: a {type(layer).__name__} has no attention module named "
                       f"{' / '.join(ATTENTION_NAMES)}")


def hooked_modules(model) -> list[dict[str, nn.Module]]:
    return [{"attention": attention_of(layer), "hidden": layer} for layer in decoder_layers(model)]


def layer_windows(n_windows: int, seq_len: int, tokens: int = LAYER_TOKENS) -> int:
    return max(1, min(n_windows, tokens // seq_len))


def expected_bytes(config, tokens: int) -> int:
    """Bytes of the source's recorded outputs for `tokens` tokens, from its config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 0
    return int(layers) * len(KINDS) * tokens * int(hidden) * 4


def _key(layer: int, kind: str, batch: int) -> str:
    return f"layer{layer}.{kind}.{batch}"


class _Hooks:
    def __init__(self, model, on_output):
        self.handles = []
        for i, modules in enumerate(hooked_modules(model)):
            for kind, module in modules.items():
                self.handles.append(module.register_forward_hook(
                    lambda m, args, out, i=i, kind=kind: on_output(i, kind, first_output(out))))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def record_layers(model, batches: list[torch.Tensor], store: SpillStore) -> int:
    """Run `batches` through the source, keeping every layer's attention output and hidden state. Returns the
    number of layers."""
    batch_index = [0]
    with _Hooks(model, lambda i, kind, out: store.put(_key(i, kind, batch_index[0]), out)):
        for b, x in enumerate(batches):
            batch_index[0] = b
            model(input_ids=x)
    return len(decoder_layers(model))


@torch.no_grad()
def compare_layers(model, batches: list[torch.Tensor], store: SpillStore, source_layers: int) -> list[dict]:
    """Relative error of every layer's attention output and hidden state against the recorded source."""
    layers = len(decoder_layers(model))
    if layers != source_layers:
        raise SurgeryError(f"--layers: the source has {source_layers} layers, the converted model {layers}")
    sums = {(i, kind): [0.0, 0.0] for i in range(layers) for kind in KINDS}  # [Σ(b-a)², Σa²]
    batch_index = [0]

    def on_output(i: int, kind: str, out: torch.Tensor) -> None:
        key = _key(i, kind, batch_index[0])
        if store.shape(key) != tuple(out.shape):
            raise SurgeryError(f"--layers: layer {i}'s {kind} output has shape {tuple(out.shape)} in the converted "
                               f"model, {store.shape(key)} in the source")
        b = out.detach().float().reshape(-1, out.shape[-1])
        a = store.rows(key, 0, b.shape[0]).to(b.device)
        sums[(i, kind)][0] += (b - a).pow(2).sum(dtype=torch.float64).item()
        sums[(i, kind)][1] += a.pow(2).sum(dtype=torch.float64).item()

    with _Hooks(model, on_output):
        for b, x in enumerate(batches):
            batch_index[0] = b
            model(input_ids=x)
    rows = []
    for i in range(layers):
        row = {"layer": i}
        for kind in KINDS:
            diff, ref = sums[(i, kind)]
            row[f"{kind}_rel_error"] = math.sqrt(diff / ref) if ref > 0 else (0.0 if diff == 0 else math.inf)
        rows.append(row)
    return rows
