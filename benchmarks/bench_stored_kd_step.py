"""One distillation micro-step from a stored top-K teacher pass against one with the live teacher, in one process,
alternating (issue 41): where the step time goes and what the store saves.

The student is SmolLM2-135M converted to MQA by mean pooling, the teacher SmolLM2-135M; a micro-batch of
`--micro-batch` pydoc windows of `--seq-len`. Each round times, in turn (after one warm-up round):
  live:   teacher forward (no gradients) + student forward + `kd_loss` + backward   (what `uptrain --teacher` does)
  stored: student forward + `stored_kd_loss` on the teacher's top-K of the same windows + backward
          (what `uptrain --teacher-logprobs` does; the top-K is computed once before the rounds, as the store holds it)
and, separately, each part alone: the teacher's forward, the student's forward + backward with a plain LM loss, and
each loss with its backward on fixed logits. Medians over --rounds; alternating keeps both arms under the same
machine load. Prints the live / stored ratio of the micro-step and the parts.

    python benchmarks/bench_stored_kd_step.py [--rounds 5] [--micro-batch 4] [--seq-len 256] [--top-k 32]
        [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--work", type=Path, help="folder for the MQA conversion (default: a temporary one)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    import transformers as tf

    from surgery.checkpoint.source import resolve_source
    from surgery.data import pydoc_texts
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import MQAOptions
    from surgery.training.losses import kd_loss, lm_loss
    from surgery.training.stored_kd import stored_kd_loss
    from surgery.training.teacher_pass import top_k_of
    from surgery.training.teacher_store import StoredTargets, window_hash

    work = a.work or Path(tempfile.mkdtemp(prefix="bench-stored-kd-step-"))
    source = resolve_source("smollm2")
    mqa = work / "smollm2-mqa"
    if not (mqa / "surgery.json").exists():
        convert_to_kv_heads(source, mqa, MQAOptions(force=True), progress=False)
    student = tf.AutoModelForCausalLM.from_pretrained(mqa, dtype=torch.float32).train()
    teacher = tf.AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    teacher.requires_grad_(False)
    tokenizer = tf.AutoTokenizer.from_pretrained(source.folder)
    text = "\n\n".join(pydoc_texts()[:200])
    ids = torch.tensor(tokenizer(text)["input_ids"][: a.micro_batch * a.seq_len]).view(a.micro_batch, a.seq_len)
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits
    lp, top_ids, tail = (x.to(torch.float16) if x.is_floating_point() else x.int() for x in top_k_of(t_logits, a.top_k))
    targets = StoredTargets(lp, top_ids, tail, window_hash(ids))

    def live():
        with torch.no_grad():
            t = teacher(input_ids=ids, use_cache=False).logits
        kd_loss(student(input_ids=ids, use_cache=False).logits, t).backward()
        student.zero_grad(set_to_none=True)

    def stored():
        stored_kd_loss(student(input_ids=ids, use_cache=False).logits, targets).backward()
        student.zero_grad(set_to_none=True)

    def teacher_forward():
        with torch.no_grad():
            teacher(input_ids=ids, use_cache=False)

    def student_lm():
        lm_loss(student(input_ids=ids, use_cache=False).logits, ids).backward()
        student.zero_grad(set_to_none=True)

    fixed = student(input_ids=ids, use_cache=False).logits.detach()

    def live_loss():
        x = fixed.clone().requires_grad_()
        kd_loss(x, t_logits).backward()

    def stored_loss():
        x = fixed.clone().requires_grad_()
        stored_kd_loss(x, targets).backward()

    parts = {"live": live, "stored": stored, "teacher_forward": teacher_forward, "student_fwd_bwd_lm": student_lm,
             "kd_loss_fwd_bwd": live_loss, "stored_kd_loss_fwd_bwd": stored_loss}
    times: dict[str, list[float]] = {name: [] for name in parts}
    for r in range(a.rounds + 1):  # round 0 warms up
        for name, fn in parts.items():
            seconds = timed(fn)
            if r:
                times[name].append(seconds)
        if r:
            print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in parts), flush=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    summary = {"micro_step_live_over_stored": round(med["live"] / med["stored"], 3),
               "teacher_forward_share_of_live": round(med["teacher_forward"] / med["live"], 3),
               "stored_loss_over_live_loss": round(med["stored_kd_loss_fwd_bwd"] / med["kd_loss_fwd_bwd"], 3),
               "median_seconds": {k: round(v, 4) for k, v in med.items()},
               "threads": torch.get_num_threads(), "micro_batch": a.micro_batch, "seq_len": a.seq_len,
               "top_k": a.top_k, "vocab": int(fixed.shape[-1])}
    print(json.dumps(summary, indent=1))
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "times": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()
