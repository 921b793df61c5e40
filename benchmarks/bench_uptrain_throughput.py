"""Training throughput of `surgery uptrain` against a plain `transformers.Trainer` loop, measured in one run.

Same model, the same packed windows in the same order (so the first step's loss must agree), same optimizer (AdamW,
betas 0.9/0.95, weight decay 0.01), same clipping, same micro-batch and gradient accumulation, LM loss, fp32 on CPU
(bf16 autocast on CUDA for both). Each side runs in its own fresh process; rounds alternate surgery / Trainer so
that load from other work on the machine hits both alike (`--concurrent`: both run at the same time, each pinned
to half of the cores, swapped every round, for machines whose load changes within minutes). Tokens/s counts optimizer steps 2..N (step 1 carries
one-off kernel warm-up) and covers the step computation only (no evaluation, no checkpoint writing) for both. On CUDA,
MFU = 6 * params * tokens/s over the GPU's bf16 dense peak.

    python benchmarks/bench_uptrain_throughput.py                     # SmolLM2-135M, seq 256, 4 x 4 x 256 tokens/step
    python benchmarks/bench_uptrain_throughput.py --seq-len 128 --batch-tokens 512 --micro-batch 2   # 2-core CPU
    python benchmarks/bench_uptrain_throughput.py --seq-len 128 --batch-tokens 512 --micro-batch 2 --concurrent
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}


def windows_in_uptrain_order(folder: Path, seq_len: int, tokens: int):
    """The windows `surgery uptrain --data pydoc --eval-tokens 0 --seed 0` trains on, in the order it reads them."""
    from transformers import AutoTokenizer

    from surgery.data import pydoc_texts
    from surgery.training.data import pack

    data = pack(pydoc_texts(), AutoTokenizer.from_pretrained(folder), seq_len, eval_tokens=0, train_tokens=tokens, seed=0)
    return data.train[data.window_indices(0, tokens // seq_len)].long()


def worker_surgery(a) -> dict:
    from surgery.training import UptrainOptions, uptrain
    from surgery.training.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        uptrain(UptrainOptions(model=a.model, out=out, data="pydoc", tokens=a.steps * a.batch_tokens, seq_len=a.seq_len,
                               batch_tokens=a.batch_tokens, micro_batch=a.micro_batch, eval_tokens=0, save_every=0,
                               loss="lm", lr=1e-4, warmup_steps=1, progress=False))
        rows = [m for m in read_metrics(out / "uptrain_metrics.jsonl") if "loss" in m]
    seconds = rows[-1]["elapsed"] - rows[0]["elapsed"]
    return {"tokens_per_s": a.batch_tokens * (len(rows) - 1) / seconds, "losses": [m["loss"] for m in rows]}


def worker_trainer(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    cuda = torch.cuda.is_available()
    windows = windows_in_uptrain_order(Path(a.model), a.seq_len, a.steps * a.batch_tokens)
    rows = [{"input_ids": w, "labels": w} for w in windows]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)

    class InOrderTrainer(Trainer):  # the same windows in the same order as uptrain, so step losses compare
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    accum = a.batch_tokens // a.seq_len // a.micro_batch
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=a.micro_batch,
                                 gradient_accumulation_steps=accum, max_steps=a.steps, learning_rate=1e-4,
                                 lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.01, adam_beta2=0.95,
                                 max_grad_norm=1.0, logging_steps=1, save_strategy="no", eval_strategy="no",
                                 report_to=[], use_cpu=not cuda, bf16=cuda, dataloader_num_workers=0,
                                 disable_tqdm=True, seed=0)
        trainer = InOrderTrainer(model=model, args=args, train_dataset=rows, callbacks=[Stamp()])
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"tokens_per_s": a.batch_tokens * (len(stamps) - 1) / (stamps[-1] - stamps[0]), "losses": losses}


def worker_cmd(kind: str, a, cores: list[int] | None = None) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", a.model, "--steps", str(a.steps), "--seq-len",
           str(a.seq_len), "--batch-tokens", str(a.batch_tokens), "--micro-batch", str(a.micro_batch)]
    return cmd + (["--cores", ",".join(map(str, cores))] if cores else [])


def finish_worker(kind: str, proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{kind} worker failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_round(a, r: int) -> dict[str, dict]:
    """Alternating: one worker after the other, each with every core. Concurrent: both at once, each pinned to
    half of the cores (swapped every round), so that load from elsewhere on the machine hits both at the same time."""
    kinds = ("surgery", "trainer")
    if not a.concurrent:
        return {k: finish_worker(k, subprocess.Popen(worker_cmd(k, a), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                     text=True)) for k in kinds}
    cores = sorted(os.sched_getaffinity(0))
    half = [cores[: len(cores) // 2], cores[len(cores) // 2 :]]
    if r % 2:
        half.reverse()
    procs = {k: subprocess.Popen(worker_cmd(k, a, c), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in zip(kinds, half)}
    return {k: finish_worker(k, p) for k, p in procs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="checkpoint folder, or smollm2 (the embedded SmolLM2-135M)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--rounds", type=int, default=2, help="alternating surgery / Trainer rounds")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--concurrent", action="store_true",
                   help="run both at once, each pinned to half of the cores (for a machine shared with other work)")
    p.add_argument("--worker", choices=["surgery", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--cores", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        if a.cores:
            import torch

            cores = [int(c) for c in a.cores.split(",")]
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        print(json.dumps((worker_surgery if a.worker == "surgery" else worker_trainer)(a)))
        return

    import torch

    from surgery.checkpoint.source import resolve_source

    a.model = str(resolve_source(a.model).folder)
    threads = torch.get_num_threads() // (2 if a.concurrent else 1)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({threads} thread(s) per worker)"
    print(f"model {a.model}\ndevice {device}; seq {a.seq_len}, {a.batch_tokens} tokens/step = micro-batch "
          f"{a.micro_batch} x {a.batch_tokens // a.seq_len // a.micro_batch} accumulation; {a.steps} steps x {a.rounds} rounds",
          flush=True)
    results: dict[str, list[float]] = {"surgery": [], "trainer": []}
    ratios = []
    for r in range(a.rounds):
        for kind, res in run_round(a, r).items():
            results[kind].append(res["tokens_per_s"])
            print(f"round {r + 1} {kind:8s} {res['tokens_per_s']:9.2f} tokens/s  losses "
                  f"{' '.join(f'{x:.3f}' for x in res['losses'])}", flush=True)
        ratios.append(results["surgery"][-1] / results["trainer"][-1])
        print(f"round {r + 1} ratio {ratios[-1]:.3f}x", flush=True)
    ours, theirs = statistics.median(results["surgery"]), statistics.median(results["trainer"])
    print(f"median tokens/s: surgery uptrain {ours:.2f}, transformers.Trainer {theirs:.2f}; "
          f"median of the per-round ratios {statistics.median(ratios):.3f}x")
    if torch.cuda.is_available():
        from surgery.inspection import inspect_checkpoint

        params = inspect_checkpoint(Path(a.model))["parameters"]
        peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
        if peak:
            print(f"MFU (6 * {params / 1e6:.0f}M params * tokens/s / bf16 peak): surgery {6 * params * ours / peak:.1%}, "
                  f"Trainer {6 * params * theirs / peak:.1%}")


if __name__ == "__main__":
    main()
