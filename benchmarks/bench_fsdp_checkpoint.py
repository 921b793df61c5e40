"""Per-process FSDP checkpoints against the whole-model gather to the main process, in the same run.

Two processes over gloo on CPU (the FSDP path of `recipes/accelerate/fsdp-cpu.yaml`), a random Llama sharded with
FSDP2 (one unit per decoder layer) after one AdamW step, so that the optimizer holds both moments. Each layout of
surgery/training/state.py `Checkpoints` saves the same state, then resumes from it into a fresh model and optimizer:
seconds, bytes each process writes and reads, and each process's peak RSS above its level before the save (VmHWM
after resetting it, /proc/self/clear_refs), per process.

    OMP_NUM_THREADS=1 python benchmarks/bench_fsdp_checkpoint.py [--hidden 768 --layers 6 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def rss_reset() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS; the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def peak_rss() -> int:
    return _status("VmHWM")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def build(args):
    import torch
    import transformers as tf
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                            num_key_value_heads=args.hidden // 128, max_position_embeddings=256)
    model = tf.AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def worker(rank: int, args, folder: str, port: int, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    from accelerate import Accelerator

    from surgery.training.accelerator import use_fsdp_on_cpu
    from surgery.training.state import Checkpoints, RunState

    acc = Accelerator(cpu=True)
    use_fsdp_on_cpu(acc)
    model, optimizer = build(args)
    ids = torch.randint(0, args.vocab, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    state = RunState()
    state.step = 1
    row = {}
    for layout, per_process in (("per-process", True), ("whole (gather to rank 0)", False)):
        run = Path(folder) / ("shards" if per_process else "whole")
        ckpts = Checkpoints(run, keep_last=1, accelerator=acc, per_process=per_process)
        acc.wait_for_everyone()
        base = rss_reset()
        start = time.perf_counter()
        path = ckpts.save(1, model, optimizer, state)
        save_s = time.perf_counter() - start
        save_peak = peak_rss() - base
        manifest = json.loads((path / "manifest.json").read_text())
        from surgery.training.state import owner

        written = sum(e["size"] for name, e in manifest["files"].items()
                      if owner(name) == rank or (owner(name) is None and rank == 0 and name != "run-state.json")
                      or (name == "run-state.json" and rank == 0))
        fresh, fresh_opt = build(args)
        acc.wait_for_everyone()
        base = rss_reset()
        start = time.perf_counter()
        ckpts.load_latest(fresh, fresh_opt, RunState())
        load_s = time.perf_counter() - start
        load_peak = peak_rss() - base
        read = sum(e["size"] for name, e in manifest["files"].items() if owner(name) in (None, rank))
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters()))
        row[layout] = dict(save_s=save_s, load_s=load_s, written=written, read=read, save_peak=save_peak,
                           load_peak=load_peak, same=same)
        del fresh, fresh_opt
    results[rank] = row
    acc.end_training()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args, folder, 29500 + os.getpid() % 1000, results), nprocs=2)
        results = dict(results)
    mib = 1 << 20
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}; 2 processes, FSDP2 over gloo")
    print("| layout | process | save s | resume s | written MiB | read on resume MiB | save peak RSS +MiB | "
          "resume peak RSS +MiB | resumed equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rank in sorted(results):
        for layout, r in results[rank].items():
            print(f"| {layout} | {rank} | {r['save_s']:.2f} | {r['load_s']:.2f} | {r['written'] / mib:.0f} | "
                  f"{r['read'] / mib:.0f} | {r['save_peak'] / mib:.0f} | {r['load_peak'] / mib:.0f} | {r['same']} |")
    for rank in sorted(results):
        a, b = results[rank]["per-process"], results[rank]["whole (gather to rank 0)"]
        print(f"process {rank}: per-process / whole: save {a['save_s'] / b['save_s']:.2f}x time, resume "
              f"{a['load_s'] / b['load_s']:.2f}x time, {a['read'] / b['read']:.2f}x bytes read, save peak RSS "
              f"+{a['save_peak'] / (1 << 20):.0f} vs +{b['save_peak'] / (1 << 20):.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
