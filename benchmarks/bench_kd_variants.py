"""Two KD variants for an MQA/GQA conversion that `surgery uptrain` does not ship, measured against plain KD (issue 15).

- `--fade F`: a gradual merge. The student starts as the source (its original K/V heads) and every weight the
  conversion changed moves linearly to the converted one over the first F of the steps, while KD trains the converted
  weights underneath (W_eff = W_trained + (1 - t) (W_source - W_converted), the K/V weights repeated over their
  group); from then on the student is the converted model. Progressive fusion in the manner of DHA (Chen et al.
  2024) and gradual pruning.
- `--attn-weight A`: attention-map distillation (MiniLM's self-attention transfer at every layer): + A times the
  mean over layers of KL(source's attention row ‖ student's) per head and query, both models in eager attention.

With `--fade 0 --attn-weight 0` the run is plain KD, step for step the computation of `surgery uptrain` with the
options below (the first two steps' losses agree with it to the printed digit): run it as the baseline. The protocol
is bench_uptrain_recovery.py's W1024 run: SmolLM2-135M, pydoc, windows of 1,024, one window per step, AdamW lr 3e-4
(betas 0.9/0.95, weight decay 0.01), 5% warmup, cosine to 10%, clipping 1.0; held-out = pydoc's first 4,096 tokens
(whole documents, never trained on), evaluated every 12 steps.

    python benchmarks/bench_kd_variants.py CONVERTED --json R.json [--fade 0.5] [--attn-weight 1] [--tokens 49152]

The JSON holds every step's loss and the held-out perplexity of the converted model (t = 1) every 12 steps; the final
weights are loaded into CONVERTED's own architecture and evaluated there too (the same number: the student at t = 1
is exactly the converted model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize


from surgery.data import load_texts  # noqa: E402
from surgery.checkpoint.source import resolve_source  # noqa: E402
from surgery.training.data import pack  # noqa: E402
from surgery.training.optimizer import lr_at  # noqa: E402
from surgery.training.losses import kd_loss, lm_loss  # noqa: E402
from surgery.training.options import UptrainOptions  # noqa: E402


class Clock:
    """The fade's position: 0 = the source's weights, 1 = the converted ones."""

    t = 1.0


class Fade(nn.Module):
    """A parametrization: the trained (converted-shape) weight, repeated over the K/V group, plus the fading rest."""

    def __init__(self, diff: torch.Tensor, repeat: int, clock: Clock):
        super().__init__()
        self.register_buffer("diff", diff)
        self.repeat, self.clock = repeat, clock

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        w = w.repeat(self.repeat, 1) if self.repeat > 1 else w
        return w if self.clock.t >= 1 else w + (1 - self.clock.t) * self.diff


def fading_student(source: str, converted: str, clock: Clock, **load) -> nn.Module:
    """The source's architecture whose linear weights that the conversion changed are `Fade` parametrizations over
    the converted weights (K/V projections: one head's weights repeated over its group)."""
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **load)
    conv = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).state_dict()
    ours = student.state_dict()
    faded = []
    for name, module in student.named_modules():
        key = name + ".weight"
        if not isinstance(module, nn.Linear) or torch.equal(conv[key], ours[key]):
            continue
        c, s = conv[key], ours[key]
        repeat = s.shape[0] // c.shape[0]
        module.weight = nn.Parameter(c.clone())
        fade = Fade(s - c.repeat(repeat, 1), repeat, clock)
        parametrize.register_parametrization(module, "weight", fade, unsafe=True)
        faded.append(key)
    others = [k for k in conv if k not in faded and not torch.equal(conv[k], ours[k])]
    if others:
        sys.exit(f"the conversion changed tensors that are not linear weights: {others[:3]}")
    return student


def attention_kl(student_maps, teacher_maps) -> torch.Tensor:
    """Mean over layers of the mean over heads and queries of KL(teacher row ‖ student row)."""
    total = 0.0
    for s, t in zip(student_maps, teacher_maps):
        total = total + (t * (torch.log(t.clamp_min(1e-12)) - torch.log(s.clamp_min(1e-12)))).sum(-1).mean()
    return total / len(student_maps)


def converted_weights(student: nn.Module) -> dict:
    """The student's state dict in the converted checkpoint's names (a parametrization's trained `original`)."""
    out = {}
    for k, v in student.state_dict().items():
        if ".parametrizations." not in k:
            out[k] = v
        elif k.endswith(".original"):
            out[k.replace(".parametrizations.weight.original", ".weight")] = v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("converted", help="the converted checkpoint (MQA/GQA, surgery convert's output)")
    p.add_argument("--source", default="smollm2")
    p.add_argument("--fade", type=float, default=0.0, help="fraction of the steps over which the merge fades in")
    p.add_argument("--attn-weight", type=float, default=0.0, help="weight of the attention-map KL")
    p.add_argument("--tokens", type=int, default=49152)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    o = UptrainOptions(model=a.converted, out=Path("unused"), data="pydoc", tokens=a.tokens, seq_len=1024, batch_tokens=1024,
                       micro_batch=1, lr=a.lr, eval_tokens=4096)
    source = resolve_source(a.source).folder
    load = {"attn_implementation": "eager"} if a.attn_weight else {}
    clock = Clock()
    teacher = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **load).eval().requires_grad_(False)
    student = fading_student(source, a.converted, clock, **load)
    tokenizer = AutoTokenizer.from_pretrained(source)
    data = pack(load_texts("pydoc"), tokenizer, o.seq_len, o.eval_tokens, o.steps * o.seq_len, seed=o.seed)
    params = list(student.parameters())
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=o.weight_decay, fused=True)
    fade_steps = round(a.fade * o.steps)

    @torch.no_grad()
    def perplexity(model) -> float:
        was = model.training
        model.eval()
        ids = data.eval.long()
        losses = [lm_loss(model(input_ids=ids[i : i + 1], use_cache=False).logits, ids[i : i + 1]).item()
                  for i in range(ids.shape[0])]
        model.train(was)
        return math.exp(sum(losses) / len(losses))

    rows = [dict(step=0, converted_ppl=perplexity(student), teacher_ppl=perplexity(teacher))]
    print(rows[-1], flush=True)
    student.train()
    start = time.time()
    for step in range(o.steps):
        clock.t = min(1.0, (step + 1) / fade_steps) if fade_steps else 1.0
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o)
        ids = data.step_batch(step, 1, 0, 1)
        maps = {"output_attentions": True} if a.attn_weight else {}
        with torch.no_grad():
            t_out = teacher(input_ids=ids, use_cache=False, **maps)
        s_out = student(input_ids=ids, use_cache=False, **maps)
        kd = kd_loss(s_out.logits, t_out.logits)
        attn = attention_kl(s_out.attentions, t_out.attentions) if a.attn_weight else torch.zeros(())
        (kd + a.attn_weight * attn).backward()
        del s_out, t_out
        grad_norm = torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = dict(step=step + 1, t=clock.t, kd=kd.item(), attn=float(attn), grad_norm=float(grad_norm),
                   seconds=round(time.time() - start))
        if (step + 1) % 12 == 0 or step + 1 == o.steps:
            saved, clock.t = clock.t, 1.0
            row["converted_ppl"] = perplexity(student)
            clock.t = saved
        rows.append(row)
        print(row, flush=True)

    clock.t = 1.0
    final = AutoModelForCausalLM.from_pretrained(a.converted, dtype=torch.float32)
    final.load_state_dict(converted_weights(student))
    summary = dict(final_ppl=perplexity(final), teacher_ppl=rows[0]["teacher_ppl"], fade=a.fade,
                   attn_weight=a.attn_weight, tokens=o.steps * o.batch_tokens)
    summary["ratio"] = summary["final_ppl"] / summary["teacher_ppl"]
    print(f"final: {summary['final_ppl']:.3f} = {summary['ratio']:.3f}x the source ({summary['teacher_ppl']:.3f})")
    a.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
