"""One pass of the source over calibration text, layer by layer: what each mixer's initialisation reads (the mean
of the layer's normed input; the gated norm's weight, fitted per channel by least squares to the attention's output
before o_proj) and, for `--attention-layers auto`, what each layer would lose if its attention were replaced by that
mixer.

The source streams one decoder layer at a time (surgery.calibration.stream); each layer runs on the source's own
hidden states (teacher-forced), so a layer's score is local: the squared distance between its attention's output
and its initialised mixer's output on the same input, over the squared norm of the residual stream entering the
layer (how far the replacement moves the stream, relative to the stream). The layers that would move it most keep
their attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..calibration.stream import open_stream, run_layer
from ..progress import Progress
from .init import gate_direction, mixer_tensors


@dataclass
class LayerStats:
    mean_input: torch.Tensor  # [hidden]
    norm_weight: torch.Tensor  # [heads * head_dim]
    score: float | None = None  # relative residual-stream change when replaced (None: not scored)
    gate_open: float | None = None  # share of calibration tokens whose gate is positive


@dataclass
class Calibration:
    layers: dict[int, LayerStats] = field(default_factory=dict)


def _bamba_mixer(target: dict, index: int, tensors: dict[str, torch.Tensor], device):
    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer

    config = BambaConfig(**{k: v for k, v in target.items() if k not in ("architectures", "model_type", "dtype")})
    mixer = BambaMixer(config, layer_idx=index).to(device=device, dtype=torch.float32)
    mixer.load_state_dict({k: v.to(device) for k, v in tensors.items()})
    return mixer.eval()


@torch.no_grad()
def calibrate(folder, reader, windows: torch.Tensor, device: torch.device, chunk_windows: int, sizes: dict,
              target: dict, conv_kernel: int, context: int, layers: list[int], score: bool,
              progress: bool = True) -> Calibration:
    """Statistics of `layers` (and, with `score`, their scores) over `windows` [N, L] of calibration tokens."""
    stream = open_stream(folder, reader, device)
    chunks = [windows[i:i + chunk_windows] for i in range(0, len(windows), chunk_windows)]
    hidden, calls = stream.embed_chunks(chunks)
    stream.release_embeddings()
    wanted, last = set(layers), max(layers, default=-1)
    out = Calibration()
    with Progress(last + 1, "calibrate mixers" + (" and score layers" if score else ""), enabled=progress,
                  unit="layer") as bar:
        for index, _, layer in stream.layers():
            if index > last:
                break
            captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
            seen: dict = {}
            attention, o_proj = layer.self_attn, layer.self_attn.o_proj

            def on_attention(module, args, kwargs):
                seen["input"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

            def on_o_proj(module, args, output):
                seen["pre_o"], seen["out"] = args[0], output

            hooks = [attention.register_forward_pre_hook(on_attention, with_kwargs=True),
                     o_proj.register_forward_hook(on_o_proj)]
            try:
                for i in range(len(hidden)):
                    h = stream.fetch(hidden[i])
                    new = run_layer(layer, h, calls[i][index])
                    if index in wanted:
                        captured.append((seen["input"].float(), seen["pre_o"].float(), seen["out"].float(), h))
                    hidden[i] = stream.stash(new)
            finally:
                for hook in hooks:
                    hook.remove()
            if index in wanted:
                out.layers[index] = _layer_stats(layer, index, captured, sizes, target, conv_kernel, context, score,
                                                 device)
            bar.update(1)
    return out


def _layer_stats(layer, index, captured, sizes, target, conv_kernel, context, score, device) -> LayerStats:
    tokens = sum(c[0].shape[0] * c[0].shape[1] for c in captured)
    mean_input = (sum(c[0].sum(dim=(0, 1)).double() for c in captured) / tokens).float().cpu()
    u = gate_direction(mean_input).to(device)
    gate_open = float(sum(int((c[0] @ u > 0).sum()) for c in captured) / tokens)
    attn = layer.self_attn
    # the mixer with a unit norm weight: its normed output n per channel, fitted to the attention's a (pre-o_proj)
    tensors = mixer_tensors(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight, sizes,
                            conv_kernel, context, mean_input)
    mixer = _bamba_mixer(target, index, tensors, device)
    normed: list[torch.Tensor] = []
    hook = mixer.norm.register_forward_hook(lambda m, args, out: normed.append(out.float()))
    try:
        for c in captured:
            mixer(c[0])
    finally:
        hook.remove()
    cross = sum((n * c[1]).sum(dim=(0, 1)).double() for n, c in zip(normed, captured))
    power = sum(n.pow(2).sum(dim=(0, 1)).double() for n in normed)
    weight = torch.where(power > 0, cross / power.clamp_min(1e-30), torch.zeros_like(power)).float()
    stats = LayerStats(mean_input, weight.cpu(), gate_open=gate_open)
    if score:
        moved, stream = 0.0, 0.0
        for n, (_, _, attention_out, residual) in zip(normed, captured):
            moved += float(((n * weight) @ attn.o_proj.weight.T - attention_out).double().pow(2).sum())
            stream += float(residual.double().pow(2).sum())
        stats.score = moved / max(stream, 1e-30)
    return stats
