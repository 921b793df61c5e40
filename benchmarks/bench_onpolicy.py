"""On-policy distillation (`surgery uptrain --on-policy P`) against off-policy KD at equal wall-clock, on CPU (issue 41).

The student is SmolLM2-135M converted to MQA by mean pooling; the teacher its source. Both arms are `surgery uptrain`
with the same data (pydoc), windows, batch, optimizer and schedule shape; the on-policy arm lets the student
continue a fraction P of the micro-batches (prompt = a window's first seq_len - gen_tokens tokens, sampled at
--gen-temperature) and distils the teacher on those continuations. Equal wall-clock: the off-policy arm runs
--steps steps; its measured seconds per step, and the student's generation time for one micro-batch timed here
beforehand, give the on-policy arm the number of steps that should take as long (a generating micro-batch costs the
same forward and backward as any other, plus its generation). Both arms' measured training seconds are printed.

Afterwards `surgery check SOURCE STUDENT --generate N` (in-process: check_checkpoints) on two held-out texts,
neither trained on: pydoc's first --eval-tokens tokens (the documents uptrain holds out: other pydoc topics than
the training windows) and Python source code (`inspect.getsource` of the stdlib modules in PY_MODULES, another
domain); its greedy prompts are cut from the first. Reported per arm (and for the untrained MQA conversion): greedy
token agreement with the source, first divergence, forced agreement, perplexity ratio to the source on both texts.

    python benchmarks/bench_onpolicy.py --work /tmp/onpolicy --steps 16 --on-policy 0.5 --json R.json

`--student FOLDER` starts both arms from another checkpoint of SmolLM2 (e.g. a conversion already distilled: on-policy
distillation is meant for a student whose own text is worth scoring). `--parallel` runs the two arms at the same
time, one torch thread each, so that both meet the same machine load (on a shared machine the load moves between
two sequential arms more than the arms differ); the on-policy arm's step count then comes from a one-thread timing,
taken here first, of one micro-batch's training step (student forward and backward, teacher forward) and of one
micro-batch's generation.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

import torch

PY_MODULES = ("textwrap", "shlex")  # the second held-out text: their source code


def python_source(path: Path) -> Path:
    import importlib

    text = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in PY_MODULES)
    path.write_text(text)
    return path


def student(work: Path) -> Path:
    from surgery.checkpoint.source import resolve_source
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import MQAOptions

    out = work / "mqa-mean"
    if not (out / "surgery.json").exists():
        convert_to_kv_heads(resolve_source("smollm2"), out, MQAOptions(force=True), progress=False)
    return out


def generation_seconds(folder: Path, micro_batch: int, seq_len: int, gen_tokens: int, temperature: float) -> float:
    """The student's time to continue one micro-batch of prompts (median of 3), as the loop generates."""
    import transformers as tf

    from surgery.training.onpolicy import OnPolicy

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    policy = OnPolicy(1.0, gen_tokens, temperature, 0)
    times = sorted(policy.rollout(model, prompts, policy.generator(0, i, 0, prompts.device))[2] for i in range(3))
    return times[1]


def micro_step_seconds(folder: Path, micro_batch: int, seq_len: int) -> float:
    """One micro-batch's KD training work (student forward + backward, teacher forward), median of 3, as timed here."""
    import transformers as tf

    from surgery.checkpoint.source import resolve_source
    from surgery.training.losses import kd_loss

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    teacher = tf.AutoModelForCausalLM.from_pretrained(resolve_source("smollm2").folder, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with torch.no_grad():
            t = teacher(input_ids=ids).logits
        kd_loss(model(input_ids=ids).logits, t).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return sorted(times)[1]


def options(folder: Path, out: Path, eval_data: Path, args, steps: int, on_policy: float):
    from surgery.training import UptrainOptions

    return UptrainOptions(model=str(folder), out=out, data="pydoc", eval_data=str(eval_data), txt_unit="file",
                       tokens=steps * args.batch_tokens, seq_len=args.seq_len, batch_tokens=args.batch_tokens,
                       micro_batch=args.micro_batch, eval_tokens=args.eval_tokens, eval_every=0, save_every=0,
                       lr=args.lr, loss="kd", on_policy=on_policy, gen_tokens=args.gen_tokens,
                       gen_temperature=args.gen_temperature, kd_divergence=args.divergence, kd_beta=args.beta,
                       force=True, progress=False, seed=args.seed)


def train(folder: Path, out: Path, eval_data: Path, args, steps: int, on_policy: float) -> dict:
    from surgery.training import uptrain

    return uptrain(options(folder, out, eval_data, args, steps, on_policy))


def train_both(folder: Path, work: Path, eval_data: Path, args, off_steps: int, on_steps: int) -> tuple[dict, dict]:
    """Both arms at once, each `surgery uptrain` in its own process with one torch thread; their records."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    code = ("import sys, json; from pathlib import Path; sys.path.insert(0, {here!r}); import bench_onpolicy as b; "
            "from surgery.training import uptrain; import argparse; a = argparse.Namespace(**json.loads(sys.argv[1])); "
            "print(json.dumps(uptrain(b.options(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), a, "
            "int(sys.argv[5]), float(sys.argv[6]))), default=str))").format(here=str(Path(__file__).parent))
    plain = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    procs = [subprocess.Popen([sys.executable, "-c", code, plain, str(folder), str(work / arm), str(eval_data),
                               str(steps), str(p)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for arm, steps, p in (("off", off_steps, 0.0), ("on", on_steps, args.on_policy))]
    records = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            sys.exit(f"an arm failed:\n{err[-3000:]}")
        records.append(json.loads(out.strip().splitlines()[-1]))
    return records[0], records[1]


def check(folder: Path, eval_data: Path, args) -> dict:
    from surgery.commands.check import CheckOptions, check_checkpoints

    o = CheckOptions(data=["pydoc", str(eval_data)], tokens=args.eval_tokens, seq_len=args.seq_len, batch_size=4,
                     generate=args.new_tokens, device="cpu")
    report = check_checkpoints("smollm2", str(folder), o, warn=lambda *a, **k: None)
    texts = report["texts"]
    g = report["generation"]
    return {"greedy_agreement": g["token_agreement"], "first_divergence": g.get("mean_first_divergence"),
            "forced_agreement": g.get("forced_agreement"),
            "ppl_ratio_pydoc": texts[0]["ppl_converted"] / texts[0]["ppl_source"],
            "ppl_ratio_python": texts[1]["ppl_converted"] / texts[1]["ppl_source"],
            "ppl_pydoc": texts[0]["ppl_converted"], "ppl_python": texts[1]["ppl_converted"],
            "ppl_source_pydoc": texts[0]["ppl_source"], "ppl_source_python": texts[1]["ppl_source"],
            "kl_pydoc": texts[0]["kl"], "kl_python": texts[1]["kl"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--steps", type=int, default=16, help="Off-policy KD steps; the on-policy arm gets as many seconds.")
    p.add_argument("--on-policy", type=float, default=0.5)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--gen-temperature", type=float, default=1.0)
    p.add_argument("--divergence", default="forward")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=32, help="Greedy tokens per prompt in the check.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zero-shot", action="store_true", help="Also check the untrained MQA conversion.")
    p.add_argument("--json", type=Path)
    p.add_argument("--student", type=Path, help="Start both arms from this checkpoint (default: mean-pooled MQA).")
    p.add_argument("--parallel", action="store_true", help="Run both arms at once, one thread each (see above).")
    args = p.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(torch.get_num_threads())
    folder = args.student or student(args.work)
    pysrc = python_source(args.work / "python-source.txt")
    results: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "python_modules": PY_MODULES}
    if args.zero_shot:
        results["zero_shot"] = check(folder, pysrc, args)
        print("zero-shot:", json.dumps(results["zero_shot"]), flush=True)

    accum = args.batch_tokens // args.seq_len // args.micro_batch
    if args.parallel:  # the arms' relative cost timed first, with one thread as each arm will run
        torch.set_num_threads(1)
        micro = micro_step_seconds(folder, args.micro_batch, args.seq_len)
        gen = generation_seconds(folder, args.micro_batch, args.seq_len, args.gen_tokens, args.gen_temperature)
        per_step, on_step = accum * micro, accum * (micro + args.on_policy * gen)
        on_steps = max(1, round(args.steps * per_step / on_step))
        print(f"one thread: a micro-batch's training {micro:.2f}s, its generation {gen:.2f}s; {args.steps} off-policy "
              f"steps against {on_steps} on-policy steps, run at the same time", flush=True)
        off, on = train_both(folder, args.work, pysrc, args, args.steps, on_steps)
    else:
        start = time.perf_counter()
        off = train(folder, args.work / "off", pysrc, args, args.steps, 0.0)
        print(f"off-policy: {off['train_seconds']:.1f}s of training for {off['steps']} steps "
              f"({time.perf_counter() - start:.0f}s wall in all)", flush=True)
        per_step = off["train_seconds"] / off["steps"]
        gen = generation_seconds(folder, args.micro_batch, args.seq_len, args.gen_tokens, args.gen_temperature)
        on_step = per_step + args.on_policy * accum * gen
        on_steps = max(1, round(off["train_seconds"] / on_step))
        print(f"generation of one micro-batch {gen:.2f}s; on-policy step estimated {on_step:.2f}s against "
              f"{per_step:.2f}s: {on_steps} on-policy steps", flush=True)
        on = train(folder, args.work / "on", pysrc, args, on_steps, args.on_policy)
    rows = [json.loads(line) for line in (args.work / "on" / "uptrain_metrics.jsonl").read_text().splitlines()]
    shares = [r["gen_share"] for r in rows if "gen_share" in r]
    results["off"] = {"steps": off["steps"], "tokens": off["tokens"], "train_seconds": off["train_seconds"],
                      "final_eval_ppl": off["final_eval_ppl"], "final_other_eval_ppl": off["final_other_eval_ppl"]}
    results["on"] = {"steps": on["steps"], "tokens": on["tokens"], "train_seconds": on["train_seconds"],
                     "gen_seconds": on["on_policy"]["gen_seconds"], "mean_gen_share": sum(shares) / len(shares),
                     "final_eval_ppl": on["final_eval_ppl"], "final_other_eval_ppl": on["final_other_eval_ppl"]}
    print("trained:", json.dumps({k: results[k] for k in ("off", "on")}), flush=True)
    for arm in ("off", "on"):
        results[arm] |= check(args.work / arm, pysrc, args)
        print(f"{arm}:", json.dumps(results[arm]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
