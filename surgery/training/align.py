"""Layer-local alignment (`uptrain --stage align`): each converted attention learns to reproduce the source's.

For decoder layer i, the teacher (the source) is run up to layer i on the alignment windows; its residual stream
there is the input of both layers i, teacher's and student's, and each attention receives what its own layer
passes it (normalised hidden states, position embeddings, its own mask format). The student's attention
parameters (projections and any new parameters: mixing matrices, routers, experts) are trained to minimise the
mean squared error to the teacher's attention output, normalised by the variance of that output. Then layer i+1,
from the teacher's hidden states after layer i.

Memory is one layer's worth: the teacher's residual stream at the current layer for the alignment windows
(tokens x hidden size), that layer's attention inputs and outputs, and one attention's optimizer state. On an
accelerator these live on the host and reach the device one micro-batch at a time (`Placement`): the device holds
the models, one micro-batch's tensors and the attention being trained, however many windows align. The
teacher's hidden states are advanced one decoder layer at a time by calling that layer with the keyword
arguments the model passed its first layer (captured by a hook), so nothing here knows an architecture's names
beyond its list of decoder layers and the attention module inside each.

The relative error `mean((student - teacher)^2) / var(teacher)` of every layer, before and after, is measured
on held-out windows the training never sees; the run records it in surgery.json. The last micro-batch of the
alignment windows is kept out of the fit to validate it: a layer whose error there rose keeps its old weights.

A hybrid student (`--to hybrid`: a Bamba checkpoint) has a state-space mixer instead of the attention in some layers
(`mamba`, MIXER_NAME): that mixer is trained, its parameters only, to reproduce the teacher layer's attention output
from the same normed input the attention received (the layer calls it with `hidden_states`, its mask and no cache).
The layers it kept as attention, their weights identical to the teacher's, compute the teacher's function already:
they are skipped (logged, and recorded with `"skipped"`), the teacher's residual stream just moves past them.

Every layer receives the keyword arguments its own model passes it (captured by one pass up to the last layer per
shape of micro-batch): layers of different types get different masks (a hybrid's mixers a padding mask, its
attention a causal one; a sliding-window model's global layers another mask than its windowed ones).
"""

from __future__ import annotations

import re
import time

import torch
from torch import nn

from ..calibration.stream import StopForward, first_output, run_until_stopped
from ..errors import SurgeryError

ATTENTION_NAME = re.compile(r"self_attn|attn|attention|self_attention")
MIXER_NAME = re.compile(r"mamba|mixer")  # a hybrid's state-space mixer in place of the attention (Bamba: `mamba`)
KEPT = "attention kept from the source: identical to the teacher's"


def decoder_layers(model) -> nn.ModuleList:
    """The model's list of decoder layers: the ModuleList with one entry per hidden layer."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise SurgeryError(f"--stage align: cannot find the {n} decoder layers of {type(model).__name__}")


def child_named(layer: nn.Module, pattern: re.Pattern) -> nn.Module | None:
    """The layer's first child module whose name `pattern` matches whole, None when none does."""
    return next((child for name, child in layer.named_children() if pattern.fullmatch(name)), None)


def attention_of(layer: nn.Module) -> nn.Module:
    attention = child_named(layer, ATTENTION_NAME)
    if attention is not None:
        return attention
    raise SurgeryError(f"--stage align: the decoder layer {type(layer).__name__} has no attention module "
                       "(self_attn, attn, attention or self_attention)")


def mixer_of(layer: nn.Module) -> nn.Module | None:
    """A hybrid layer's state-space mixer (the module in place of its attention), None in an attention layer."""
    return child_named(layer, MIXER_NAME)


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    """The two modules hold the same tensors under the same names (compared in float32 where dtypes differ)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        pa[n].shape == pb[n].shape and torch.equal(pa[n].detach().float(), pb[n].detach().to(pa[n].device).float())
        for n in pa)


def aligned_module(s_layer: nn.Module, t_attn: nn.Module, hybrid: bool) -> tuple[str, nn.Module | None]:
    """What layer `s_layer` trains against the teacher's attention `t_attn`: ("mixer", its mixer), ("attention", its
    attention), or ("attention", None) for a hybrid's attention kept from the source (its weights the teacher's)."""
    mixer = mixer_of(s_layer)
    if mixer is not None:
        return "mixer", mixer
    s_attn = attention_of(s_layer)
    return "attention", (None if hybrid and _same_weights(s_attn, t_attn) else s_attn)


def check_alignable(student, teacher, option: str = "--stage align") -> None:
    """`option` (the alignment, or --hidden-weight) compares layer i with the teacher's layer i."""
    s, t = decoder_layers(student), decoder_layers(teacher)
    sh, th = student.get_input_embeddings().weight.shape[1], teacher.get_input_embeddings().weight.shape[1]
    if len(s) != len(t) or sh != th:
        raise SurgeryError(f"{option} needs a teacher with the student's layers (the source it was converted "
                           f"from): the student has {len(s)} layers of width {sh}, the teacher {len(t)} of width {th}")
    if option == "--stage align":  # every teacher layer has an attention to reproduce, every student layer a module
        for i, (t_layer, s_layer) in enumerate(zip(t, s)):  # to train: refused now, not layers into the stage
            if child_named(t_layer, ATTENTION_NAME) is None:
                raise SurgeryError(f"--stage align: the teacher's layer {i} ({type(t_layer).__name__}) has no attention "
                                   "to reproduce: the teacher must be the attention model the student was converted "
                                   "from")
            if mixer_of(s_layer) is None:
                attention_of(s_layer)


class Placement:
    """Where the alignment computes (`device`) and where it keeps every micro-batch's tensors between uses (`store`:
    the host when computing on an accelerator, else the device itself, where moving is free)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.store = torch.device("cpu") if self.device.type != "cpu" else self.device

    def _move(self, obj, device):
        if isinstance(obj, torch.Tensor):
            return obj.to(device, non_blocking=device.type != "cpu")
        if isinstance(obj, (tuple, list)):
            return type(obj)(self._move(o, device) for o in obj)
        if isinstance(obj, dict):
            return {k: self._move(v, device) for k, v in obj.items()}
        return obj  # None, flags, cache objects: as they are

    def compute(self, obj):
        return self._move(obj, self.device)

    def keep(self, obj):
        return self._move(obj, self.store)


class _Batch:
    """One micro-batch of windows on its way through the teacher: residual stream and the keyword arguments each
    model passes each of its layers (`LayerKwargs`)."""

    def __init__(self, hidden: torch.Tensor, layer_kwargs: LayerKwargs, student_layer_kwargs: LayerKwargs,
                 held_out: bool):
        self.hidden, self.layer_kwargs, self.held_out = hidden, layer_kwargs, held_out
        self.student_layer_kwargs = student_layer_kwargs
        self.attn_args = self.attn_kwargs = self.target = None


class LayerKwargs:
    """The keyword arguments a model passes each decoder layer, each distinct set once (`sets`; layers of one type
    share their masks and position embeddings): layer i's are `sets[index[i]]`."""

    def __init__(self, sets: list[dict], index: list[int]):
        self.sets, self.index = sets, index

    def of(self, layer: int) -> dict:
        return self.sets[self.index[layer]]


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and isinstance(a, (int, float, str, bool, type(None))) and a == b


@torch.no_grad()
def _call_until(module: nn.Module, hooked: nn.Module, *args, **kwargs) -> tuple[tuple, dict]:
    """Call `module` until it calls `hooked`: the positional and keyword arguments `hooked` receives."""
    captured = {}

    def hook(_, a, kw):
        captured["args"], captured["kwargs"] = a, dict(kw)
        raise StopForward

    handle = hooked.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run_until_stopped(module, *args, **kwargs)
    finally:
        handle.remove()
    if "args" not in captured:
        raise SurgeryError(f"--stage align: {type(module).__name__} never called {type(hooked).__name__}")
    return captured["args"], captured["kwargs"]


def _layer_input(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
    hidden = args[0] if args else kwargs["hidden_states"]
    return hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"}


@torch.no_grad()
def _layer_inputs(model: nn.Module, layers: nn.ModuleList, ids: torch.Tensor) -> tuple[torch.Tensor, LayerKwargs]:
    """`model` run on `ids` up to its last decoder layer: its first layer's input, and every layer's keyword
    arguments (masks and position embeddings in the model's own attention implementation, per layer type)."""
    first, sets, index = {}, [], []

    def capture(i):
        def hook(_, args, kwargs):
            hidden, kw = _layer_input(args, dict(kwargs))
            if i == 0:
                first["hidden"] = hidden
            index.append(next((j for j, seen in enumerate(sets) if _same(seen, kw)), len(sets)))
            if index[-1] == len(sets):
                sets.append(kw)
            if i == len(layers) - 1:
                raise StopForward
        return hook

    handles = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        run_until_stopped(model, input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if len(index) != len(layers):
        raise SurgeryError(f"--stage align: {type(model).__name__} called {len(index)} of its {len(layers)} decoder "
                           "layers once each")
    return first["hidden"], LayerKwargs(sets, index)


@torch.no_grad()
def _enter(teacher, student, t_layers, s_layers, ids: torch.Tensor, held_out: bool, at: Placement,
           shapes: dict) -> _Batch:
    """The teacher's input to its first decoder layer, and the keyword arguments each model passes each of its
    layers, kept where `at` keeps them. Both models are called with `input_ids` alone, so their layers' keyword
    arguments (causal masks, positions) follow from the windows' shape: one pass through each model's layers per
    shape (`shapes` keeps them), then only the teacher's embedding per micro-batch."""
    ids = at.compute(ids)
    key = tuple(ids.shape)
    if key not in shapes:
        hidden, t_kwargs = _layer_inputs(teacher, t_layers, ids)
        _, s_kwargs = _layer_inputs(student, s_layers, ids)
        t_kwargs.sets, s_kwargs.sets = at.keep((t_kwargs.sets, s_kwargs.sets))
        shapes[key] = t_kwargs, s_kwargs
    else:
        hidden, _ = _layer_input(*_call_until(teacher, t_layers[0], input_ids=ids, use_cache=False))
    return _Batch(at.keep(hidden), *shapes[key], held_out)


@torch.no_grad()
def _advance(i: int, t_layer: nn.Module, t_attn: nn.Module, s_layer: nn.Module, s_attn: nn.Module | None,
             batch: _Batch, at: Placement) -> None:
    """The inputs of layer `i`'s student module `s_attn` (attention or mixer) on the teacher's residual stream, the
    teacher attention's output there; then the residual stream moves past the teacher's layer (alone where
    `s_attn` is None: a layer with nothing to align)."""
    hidden = at.compute(batch.hidden)
    if s_attn is not None:
        args, kwargs = _call_until(s_layer, s_attn, hidden, **at.compute(batch.student_layer_kwargs.of(i)))
        batch.attn_args, batch.attn_kwargs = at.keep((args, kwargs))
    target = {}

    def post(module, args, output):
        target["out"] = first_output(output).detach()

    handle = t_attn.register_forward_hook(post) if s_attn is not None else None
    try:
        batch.hidden = at.keep(first_output(t_layer(hidden, **at.compute(batch.layer_kwargs.of(i)))))
    finally:
        if handle is not None:
            handle.remove()
    if s_attn is not None:
        batch.target = at.keep(target["out"])


def _attend(attention: nn.Module, batch: _Batch, at: Placement) -> torch.Tensor:
    return first_output(attention(*at.compute(batch.attn_args), **at.compute(batch.attn_kwargs)))


@torch.no_grad()
def _relative_error(attention: nn.Module, batches: list[_Batch], at: Placement) -> float:
    err = var = 0.0
    for b in batches:
        out, target = _attend(attention, b, at).float(), at.compute(b.target).float()
        err += (out - target).pow(2).sum().item()
        var += (target - target.mean()).pow(2).sum().item()
    return err / max(var, 1e-30)


def _variance(tensors: list[torch.Tensor]) -> float:
    """The unbiased variance of all the tensors' values together, summed tensor by tensor (no concatenated copy)."""
    n, total, square = 0, 0.0, 0.0
    for t in tensors:
        t = t.double()
        n, total, square = n + t.numel(), total + t.sum().item(), square + t.square().sum().item()
    return (square - total * total / n) / max(n - 1, 1) if n else 0.0


def align(student, teacher, train_ids: torch.Tensor, held_out_ids: torch.Tensor, *, micro_batch: int, epochs: int,
          lr: float, device, log=print) -> dict:
    """Train every student attention (a hybrid's mixers in its place) on the teacher's attention inputs and outputs;
    returns the record."""
    check_alignable(student, teacher)
    s_layers, t_layers = decoder_layers(student), decoder_layers(teacher)
    was_training, flags = student.training, {n: p.requires_grad for n, p in student.named_parameters()}
    student.eval()  # no dropout: the target is deterministic
    student.requires_grad_(False)
    start = time.perf_counter()
    at = Placement(device)
    shapes = {}
    batches = [_enter(teacher, student, t_layers, s_layers, ids[i : i + micro_batch], held_out, at, shapes)
               for ids, held_out in ((train_ids, False), (held_out_ids, True))
               for i in range(0, ids.shape[0], micro_batch)]
    train = [b for b in batches if not b.held_out]
    held = [b for b in batches if b.held_out] or train
    # The last micro-batch of the alignment windows validates: a layer whose error there rose keeps its old weights
    # (the held-out windows only measure; nothing is chosen on them).
    fit, val = (train[:-1], train[-1:]) if len(train) > 1 else (train, [])
    per_layer = []
    hybrid = any(mixer_of(layer) is not None for layer in s_layers)
    try:
        for i, (s_layer, t_layer) in enumerate(zip(s_layers, t_layers)):
            t_attn = attention_of(t_layer)
            module, s_attn = aligned_module(s_layer, t_attn, hybrid)
            for b in batches:
                _advance(i, t_layer, t_attn, s_layer, s_attn, b, at)
            if s_attn is None:
                per_layer.append({"layer": i, "module": module, "skipped": KEPT})
                log(f"align: layer {i}: skipped ({KEPT})")
                continue
            params = [p for p in s_attn.parameters() if p.is_floating_point()]
            before = _relative_error(s_attn, held, at)
            val_before = _relative_error(s_attn, val, at) if val else None
            saved = [p.detach().clone() for p in params]
            # The loss of each micro-batch is normalised by the variance of the layer's whole target.
            scale = 1.0 / max(_variance([b.target for b in fit]), 1e-30)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.Adam(params, lr=lr)
            for _ in range(epochs):
                for b in fit:
                    loss = (_attend(s_attn, b, at).float() - at.compute(b.target).float()).pow(2).mean() * scale
                    if not torch.isfinite(loss):
                        raise SurgeryError(f"--stage align: the loss of layer {i} is not finite (lower --align-lr, "
                                           f"now {lr:g})")
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            for p in params:
                p.requires_grad_(False)
            del opt
            kept = not val or _relative_error(s_attn, val, at) <= val_before
            if not kept:
                with torch.no_grad():
                    for p, old in zip(params, saved):
                        p.copy_(old)
            del saved
            after = _relative_error(s_attn, held, at)
            per_layer.append({"layer": i, "before": before, "after": after, "kept": kept}
                             | ({"module": module} if hybrid else {}))
            for b in batches:
                b.attn_args = b.attn_kwargs = b.target = None
            log(f"align: layer {i}{' (mixer)' if module == 'mixer' else ''}: held-out relative error "
                f"{before:.4f} -> {after:.4f}"
                + ("" if kept else " (its validation error rose: old weights kept)"))
    finally:
        for n, p in student.named_parameters():
            p.requires_grad_(flags[n])
        student.train(was_training)
    return {"tokens": int(train_ids.numel()), "held_out_tokens": int(held_out_ids.numel()), "epochs": epochs,
            "lr": lr, "loss": "mse / var(teacher attention output)", "layers": per_layer,
            "seconds": round(time.perf_counter() - start, 3)}
