"""`--global-layers auto` scored by what windowing each layer costs, measured directly (`--layer-score cost`).

The probe: synthetic retrieval examples (surgery/retrieval_tasks.py: single and multi-key needles, passkeys) built
from the calibration text itself, each one calibration window long (4 W by default), needles at depths spread over
the window. Against a baseline (a set of global layers, the rest windowed), a candidate layer's cost is what
windowing it alone does to the probe: the drop of the answers' mean log-probability (nats per answer token) plus the
rise of the text's negative log-likelihood beyond the window (nats per token, every 4th position ≥ W). A layer that
retrieval needs loses its answers when windowed; one whose attention stays local loses nothing.

Measured leave-one-out, all candidates in one streamed pass: the layers come one at a time from the checkpoint
(surgery.calibration.stream) and each candidate is a branch of the residual stream that starts at its layer (the
baseline's input, the layer windowed) and runs every later layer as the baseline does; the branches live under the
calibration's spill policy (memory, then disk). Cost per pass: about L/2 forwards over the probe for L candidates.

Selection by successive halving (each round measured against the survivors of the last): round one from every layer
global keeps the half that costs most when windowed, the next round rescores those with the others windowed, until
the asked count is left. Layers that only matter together (one retrieval path spread over several layers) are
judged where the others they would lean on are already windowed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..calibration.stream import LayerStream, open_stream, run_layer
from ..progress import Progress
from ..retrieval_tasks import Example, make_examples

PROBE_TASKS = ("niah_single", "niah_multikey", "passkey")
LOGIT_SLICE = 256  # positions projected onto the vocabulary at a time
TEXT_STRIDE = 4  # the text's NLL beyond the window is read at every 4th position (the vocabulary projection of every
# position would cost a third of the forward passes)


def probe_examples(tokenizer, windows: torch.Tensor, seed: int = 0) -> list[Example]:
    """One retrieval example per calibration window [N, L], tasks in turn, haystacks from the calibration text (each
    its own stretch), needle depths spread over the window."""
    text = windows.reshape(-1).tolist()
    length, count = int(windows.shape[1]), int(windows.shape[0])
    out = []
    for t, task in enumerate(PROBE_TASKS):
        n = len(range(t, count, len(PROBE_TASKS)))
        if n:
            out += make_examples(task, tokenizer, length, n, seed, text)
    return out


@dataclass
class Probe:
    """The probe's token ids [N, L] and, per example, where its answer starts."""

    ids: torch.Tensor
    answer_starts: list[int]

    @classmethod
    def of(cls, examples: list[Example]) -> "Probe":
        return cls(torch.tensor([e.ids for e in examples]), [e.answer_start for e in examples])


def band(mask, length: int, window: int, device) -> torch.Tensor:
    """The layer's mask restricted to a window of `window` keys (the query and the W-1 before it): a boolean [1, 1,
    L, L] band (True attends) when the layer had no mask, the band applied to a boolean or additive mask otherwise."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    keep = (k <= q) & (k > q - window)
    if mask is None:
        return keep[None, None]
    if mask.dtype == torch.bool:
        return mask & keep[..., -mask.shape[-2]:, -mask.shape[-1]:]
    return mask.masked_fill(~keep[..., -mask.shape[-2]:, -mask.shape[-1]:], torch.finfo(mask.dtype).min)


def _windowed(call, length: int, window: int, device):
    from ..calibration.stream import LayerCall

    kwargs = dict(call.kwargs)
    kwargs["attention_mask"] = band(kwargs.get("attention_mask"), length, window, device)
    return LayerCall(call.args, kwargs)


def text_positions(window: int, answer_start: int) -> torch.Tensor:
    """The positions whose next-token NLL measures the text beyond the window: every TEXT_STRIDE-th from W up to the
    answer's (exclusive of the position that predicts its first token)."""
    return torch.arange(window, answer_start - 1, TEXT_STRIDE)


class _Head:
    """The final norm and the LM head of a streamed source (the LM head read from the checkpoint, or the embedding
    when tied): the answers' log-probabilities and the text's NLL beyond the window, a slice of positions at a time."""

    def __init__(self, stream: LayerStream, reader):
        model = stream.model
        self.norm = copy.deepcopy(model.base_model.norm)  # the stream releases its own with the embeddings
        head = model.get_output_embeddings()
        weight = head.weight
        if weight.device.type == "meta":
            name = next((n for n in ("lm_head.weight", "model.lm_head.weight") if n in reader), None)
            weight = reader.load(name) if name else model.get_input_embeddings().weight
        self.weight = weight.to(stream.device, torch.float32)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.norm(hidden).float() @ self.weight.T
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return torch.log_softmax(logits, -1)

    @torch.no_grad()
    def measure(self, hidden: torch.Tensor, ids: torch.Tensor, starts: list[int], window: int) -> tuple[float, float]:
        """(sum over the chunk's examples of the answers' mean log-prob, sum of their mean NLL beyond the window)."""
        answer, nll = 0.0, 0.0
        for b, start in enumerate(starts):
            target = ids[b, start:].to(hidden.device)
            lp = self._logprobs(hidden[b, start - 1:-1]).gather(-1, target[:, None])
            answer += float(lp.mean())
            positions = text_positions(window, start)
            total = 0.0
            for part in positions.split(LOGIT_SLICE):
                t = ids[b, part + 1].to(hidden.device)
                total -= float(self._logprobs(hidden[b, part.to(hidden.device)]).gather(-1, t[:, None]).sum())
            nll += total / max(len(positions), 1)
        return answer, nll


@torch.no_grad()
def windowing_costs(folder, reader, probe: Probe, device, window: int, chunk_windows: int,
                    global_layers: list[int], candidates: list[int], progress: bool = True,
                    desc: str = "score layers (windowing cost)") -> dict[int, dict]:
    """Per candidate layer: what windowing it alone costs the probe when `global_layers` are global and the others
    windowed (see the module docstring): {"answer": log-prob drop, "text": NLL rise, "cost": their sum}."""
    stream = open_stream(folder, reader, device, attn_implementation="sdpa")
    chunks = list(probe.ids.split(chunk_windows))
    starts = [probe.answer_starts[i:i + chunk_windows] for i in range(0, len(probe.answer_starts), chunk_windows)]
    stream.plan_offload(probe.ids.numel(), streams=2)
    base, calls = stream.embed_chunks(chunks)
    head = _Head(stream, reader)
    stream.release_embeddings()
    length = int(probe.ids.shape[1])
    keep, todo = set(global_layers), set(candidates)
    branches: dict[int, object] = {}
    # Work grows along the stack (each layer runs every branch opened below it), so the bar counts layer passes.
    passes = [1 + sum(c < i for c in todo) + (i in todo) for i in range(len(stream))]
    with Progress(sum(passes), desc, enabled=progress, unit="layer passes") as bar:
        for index, _, layer in stream.layers():
            def call(i, windowed):
                c = calls[i][index]
                return _windowed(c, length, window, stream.device) if windowed else c

            mode = index not in keep
            for branch in branches.values():
                for i in range(len(chunks)):
                    branch[i] = stream.stash(run_layer(layer, stream.fetch(branch[i]), call(i, mode)))
            if index in todo:
                new = stream.spill.stream()
                for i in range(len(chunks)):
                    new.append(stream.stash(run_layer(layer, stream.fetch(base[i]), call(i, True))))
                branches[index] = new
            for i in range(len(chunks)):
                base[i] = stream.stash(run_layer(layer, stream.fetch(base[i]), call(i, mode)))
            bar.update(passes[index])

    def measure(residual) -> tuple[float, float]:
        answer, nll = 0.0, 0.0
        for i, chunk in enumerate(chunks):
            a, n = head.measure(stream.fetch(residual[i]), chunk, starts[i], window)
            answer, nll = answer + a, nll + n
        return answer / len(probe.answer_starts), nll / len(probe.answer_starts)

    base_answer, base_nll = measure(base)
    costs = {}
    for layer_index, residual in sorted(branches.items()):
        answer, nll = measure(residual)
        costs[layer_index] = {"answer": base_answer - answer, "text": nll - base_nll,
                              "cost": (base_answer - answer) + (nll - base_nll)}
    return costs


def choose_by_cost(score_round, layers: int, count: int) -> tuple[list[int], list[dict]]:
    """Successive halving (module docstring): `score_round(global_layers, candidates)` gives each candidate's
    costs; returns the chosen layers and every round's {"global": ..., "costs": {layer: ...}}."""
    kept, rounds = list(range(layers)), []
    for target in halving_rounds(layers, count)[1:] + [count]:  # each round keeps the next round's candidates
        costs = score_round(kept, kept)
        rounds.append({"global": list(kept), "costs": {str(k): {n: round(v, 6) for n, v in c.items()}
                                                        for k, c in costs.items()}})
        ranked = sorted(kept, key=lambda i: (costs[i]["cost"], i), reverse=True)
        kept = sorted(ranked[:target])
    return kept, rounds

def halving_rounds(layers: int, count: int) -> list[int]:
    """The candidates of each round of `choose_by_cost` (every layer, then the survivors), for its cost model."""
    rounds, kept = [], layers
    while True:
        rounds.append(kept)
        kept = max(count, kept // 2)
        if kept == count:
            return rounds


def swa_cost(config: dict, layer_score: str, count: int):
    """`--global-layers auto`'s cost model for the dry run (surgery/estimate.py): per layer, `mass` runs the layer
    once and scores its attention again; `cost` runs it once for the baseline and once more per branch alive there
    (on average half of each round's candidates), and projects the answers and every 4th text position of each branch
    onto the vocabulary (counted per layer); the branches' residual streams are held up to the spill budget."""
    from ..calibration.residual import default_budget
    from ..estimate import CalibratedCost, Flops, attention_flops, mlp_flops

    layers, vocab = int(config["num_hidden_layers"]), int(config.get("vocab_size") or 0)
    if layer_score == "mass":
        return CalibratedCost("swa (attention mass)", lambda s, tokens, window: Flops(
            2 * attention_flops(s, tokens, window) + mlp_flops(s, tokens)), lambda s, chunk: 0)
    rounds = halving_rounds(layers, count)
    passes = sum(1 + k / 2 for k in rounds)

    def flops(s, tokens, window):
        head = sum(k + 1 for k in rounds) * 2 * tokens / TEXT_STRIDE * s.hidden * vocab / layers
        return Flops(passes * (attention_flops(s, tokens, window) + mlp_flops(s, tokens)) + head)

    def activations(s, tokens, window, chunk):
        return min(4 * tokens * s.hidden * (1 + rounds[0]), default_budget()) + 4 * chunk * s.hidden * 8

    return CalibratedCost("swa (windowing cost)", flops, lambda s, chunk: 0, activations=activations)
