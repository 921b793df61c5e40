"""Cost of checking one teacher-store shard as distributions (store_check.distribution_problem): a ~4 MiB shard of
K = 32 over a 49,152-token vocabulary, seq_len 1024 (21 windows), top-32 of softmax(3 * N(0, 1)) logits.

    PYTHONPATH=$PWD python benchmarks/bench_store_check.py
"""
import time

import torch

from surgery.training.store_check import distribution_problem
from surgery.training.teacher_pass import top_k_of
torch.manual_seed(0)
n, L, K, V = 21, 1024, 32, 49152
parts = [top_k_of(torch.randn(L, V) * 3, K) for _ in range(n)]
lp = torch.stack([p[0] for p in parts]).half(); ids = torch.stack([p[1] for p in parts]).int()
tail = torch.stack([p[2] for p in parts]).half()
size = lp.numel() * 2 + ids.numel() * 4 + tail.numel() * 2
best = min((lambda s: (distribution_problem(lp, ids, tail, V), time.perf_counter() - s)[1])(time.perf_counter())
           for _ in range(7))
print(f"{size / 2**20:.2f} MiB shard: {best * 1000:.1f} ms ({size / best / 1e6:.0f} MB/s), problem: "
      f"{distribution_problem(lp, ids, tail, V)}")
