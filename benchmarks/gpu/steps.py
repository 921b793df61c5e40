"""The prepared GPU run's steps (benchmarks/gpu/run.sh): random-initialised Llama-3.2-1B and Llama-3-8B (4 layers)
layouts built on the device in bf16, every kind converted, CPU-vs-device agreement of a calibrated conversion, decode
and prefill speed against each model's bytes-per-step limit, KD uptraining, and `accelerate launch` with FSDP2.

Each step is a function of a `Ctx` returning its figures; `STEPS` names them in the order they run. The driver
(benchmarks/gpu/driver.py) runs each in a child process of its own with a time limit; `--cpu` runs the same steps at
tiny shapes on the CPU (the FSDP step over gloo), which the default test suite does (tests/benchmarks/test_gpu_run.py),
so this script cannot rot. Every step goes through the toolkit's own command line (`surgery convert/check/bench/
uptrain`, run in the step's process) or functions."""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The one place the run's precision reaches the command line (`--precision`, issue 38): bf16, on the CPU too (torch's
# CPU autocast: the GPU's code path).
PRECISION = "bf16"


def precision_args(command: str) -> list[str]:
    """The precision flags of `command`: convert (plain tensor surgery, no forward pass: the output keeps the source's
    bf16), calibrated (a conversion that runs the model; its output keeps the source's dtype), check, bench,
    uptrain."""
    if command == "convert":
        return []
    return ["--precision", PRECISION] + (["--dtype", "auto"] if command == "calibrated" else [])


# ---- shapes -------------------------------------------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LAYOUTS = {
    "gpu": {
        "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                             max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE),
        "llama-3-8b-4l": dict(hidden_size=4096, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                              intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                              max_position_embeddings=8192, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 500000.0}),
    },
    "cpu": {  # the same families at tiny shapes: 8 heads, 4 K/V heads, llama3 rope scaling, untied vs tied
        "llama-3.2-1b": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
                             max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE),
        "llama-3-8b-4l": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                              intermediate_size=256, vocab_size=512, tie_word_embeddings=False,
                              max_position_embeddings=1024, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 500000.0}),
    },
}
LOGIT_STD = 4.0  # the built models' logits' spread: bf16 rounding then shows in top-1 and KL, not only in 1e-5s

# kind -> `surgery convert` options, per mode (K/V heads 8 on the GPU layouts, 4 on the CPU ones)
KINDS = {
    "gpu": {
        "mqa": ["--to", "mqa"],
        "gqa": ["--to", "gqa", "--kv-heads", "2"],
        "aligned": ["--to", "mqa", "--merge", "aligned", "--calib", "pydoc", "--calib-tokens", "2048",
                    "--calib-window", "512", "--query-samples", "64"],
        "mla": ["--to", "mla", "--kv-rank", "256", "--rope-dim", "16", "--calib", "pydoc", "--calib-tokens", "2048", "--calib-window",
                "512", "--query-samples", "64"],
        "talking-heads": ["--to", "talking-heads"],
        "switchhead": ["--to", "switchhead", "--heads", "8", "--experts", "4", "--topk", "2", "--calib", "pydoc",
                       "--calib-tokens", "2048", "--calib-window", "512"],
    },
    "cpu": {
        "mqa": ["--to", "mqa"],
        "gqa": ["--to", "gqa", "--kv-heads", "2"],
        "aligned": ["--to", "mqa", "--merge", "aligned", "--calib", "pydoc", "--calib-tokens", "256",
                    "--calib-window", "64", "--query-samples", "16"],
        "mla": ["--to", "mla", "--kv-rank", "16", "--rope-dim", "4", "--calib", "pydoc", "--calib-tokens", "256", "--calib-window", "64",
                "--query-samples", "16"],
        "talking-heads": ["--to", "talking-heads"],
        "switchhead": ["--to", "switchhead", "--heads", "4", "--experts", "2", "--topk", "1", "--calib", "pydoc",
                       "--calib-tokens", "256", "--calib-window", "64"],
    },
}
CALIBRATED = {"aligned", "mla", "switchhead"}
# the calibrated conversion run on the CPU and on the device (the CPU's share small enough for a 1B layout)
AGREE = {"gpu": ["--to", "mqa", "--merge", "aligned", "--calib", "pydoc", "--calib-tokens", "512", "--calib-window",
                 "256", "--query-samples", "32"],
         "cpu": KINDS["cpu"]["aligned"]}
BENCHED = ("mqa", "gqa", "mla", "switchhead", "talking-heads")
BENCH = {"gpu": dict(batch="1,16", context="512,4096", new="16", rounds="2"),
         "cpu": dict(batch="1,2", context="32,64", new="4", rounds="1")}
UPTRAIN = {"gpu": dict(tokens=4 * 8192, seq_len=1024, batch_tokens=8192, micro_batch=4),
           "cpu": dict(tokens=4 * 256, seq_len=64, batch_tokens=256, micro_batch=2)}
FSDP = {"gpu": dict(processes=1, seq_len=512, batch_tokens=1024, micro_batch=2),
        "cpu": dict(processes=2, seq_len=64, batch_tokens=256, micro_batch=2)}
CHECK = {"gpu": dict(tokens=8192, seq_len=512, batch_size=4), "cpu": dict(tokens=256, seq_len=64, batch_size=2)}
# bf16 dense matmul peak for MFU where the device is known (NVIDIA's datasheets, SXM); elsewhere the measured rate
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


# ---- the steps (each runs in a child process: `driver.py step NAME --work DIR [--cpu]`) -----------------------------

class Ctx:
    def __init__(self, work: Path, cpu: bool):
        import torch

        self.work, self.cpu = work, cpu
        self.mode = "cpu" if cpu else "gpu"
        self.device = "cpu" if cpu else "cuda"
        self.torch = torch

    def model(self, layout: str) -> Path:
        return self.work / "models" / layout

    def converted(self, layout: str, kind: str, device: str | None = None) -> Path:
        return self.work / "converted" / f"{layout}-{kind}{'-' + device if device else ''}"

    def reset_peak(self) -> None:
        if not self.cpu:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> dict:
        """Peak device memory since reset_peak (CUDA) and this process's peak resident memory, bytes."""
        out = {"peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if not self.cpu:
            self.torch.cuda.synchronize()
            out["peak_device_bytes"] = self.torch.cuda.max_memory_allocated()
        return out


def surgery(*args) -> None:
    """`surgery ARGS` in this process (the installed command's entry point); a non-zero exit raises."""
    from surgery.cli import main

    saved, sys.argv = sys.argv, ["surgery", *map(str, args)]
    try:
        main()
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"`surgery {' '.join(map(str, args))}` exited {e.code}") from None
    finally:
        sys.argv = saved


def step_build(ctx: Ctx) -> dict:
    """Each layout built on the device in bf16 with random weights (the output embedding scaled so the logits spread
    by about LOGIT_STD), saved with a BPE tokenizer trained on pydoc text."""
    import transformers as tf

    from surgery.testing.pydoc_llama import make_tokenizer

    torch = ctx.torch
    tokenizer = make_tokenizer()
    figures = {}
    for name, shape in LAYOUTS[ctx.mode].items():
        torch.manual_seed(0)
        # every projection at std 1/sqrt(hidden): attention logits of order one, so that the attention (and what
        # a conversion changes in it) moves the logits at tiny widths too
        config = tf.LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=tokenizer.eos_token_id,
                                eos_token_id=tokenizer.eos_token_id,
                                initializer_range=1 / math.sqrt(shape["hidden_size"]))
        start = time.perf_counter()
        with torch.device(ctx.device):
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            std = LOGIT_STD / math.sqrt(config.hidden_size)
            model.get_output_embeddings().weight.normal_(0, std)
            for n, p in model.named_parameters():  # norms start at one: make them count
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
            ids = torch.randint(0, len(tokenizer), (2, 64), device=ctx.device)
            logits = model(input_ids=ids).logits.float()
            model.float()
            reference = model(input_ids=ids).logits
            model.to(torch.bfloat16)
        built = time.perf_counter() - start
        model.save_pretrained(ctx.model(name))
        tokenizer.save_pretrained(ctx.model(name))
        figures[name] = dict(params=sum(p.numel() for p in model.parameters()), build_s=built,
                             logits_std=float(reference.std()),
                             bf16_max_abs_dlogits=float((logits - reference).abs().max()),
                             bf16_top1_agreement=float((logits.argmax(-1) == reference.argmax(-1)).float().mean()))
        del model
    return figures


def step_convert(ctx: Ctx, layout: str, kind: str, device: str | None = None, dry_run: bool = True,
                 out: Path | None = None, opts: list[str] | None = None) -> dict:
    """`surgery convert` of one kind on the device, its seconds and peak memory beside `--dry-run`'s estimate."""
    device = device or ctx.device
    opts = opts or KINDS[ctx.mode][kind]
    where = ["--device", device] if kind in CALIBRATED else []  # --device is where calibration runs
    precision = precision_args("calibrated" if kind in CALIBRATED else "convert")
    figures = {}
    if dry_run:
        estimate = ctx.work / f"estimate-{layout}-{kind}.json"
        surgery("convert", ctx.model(layout), *opts, "--dry-run", "--json", estimate, *where)
        figures["estimate"] = numbers(json.loads(estimate.read_text()))
    out = out or ctx.converted(layout, kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    ctx.reset_peak()
    start = time.perf_counter()
    surgery("convert", ctx.model(layout), *opts, "--out", out, "--force", *where, *precision)
    seconds = time.perf_counter() - start
    layers = LAYOUTS[ctx.mode][layout]["num_hidden_layers"]
    figures |= dict(seconds=seconds, seconds_per_layer=seconds / layers, **ctx.peak())
    estimate = figures.get("estimate", {})
    for measured, estimated in (("seconds_per_layer", "seconds_per_layer"), ("peak_host_rss_bytes", "host_bytes"),
                                ("peak_device_bytes", "device_bytes")):
        if estimate.get(estimated) and measured in figures:
            figures[f"{measured}_of_estimate"] = figures[measured] / estimate[estimated]
    if dry_run and (layout, kind) not in LATER:
        discard(out)
    return figures


# the conversions later steps read (bench, uptrain, fsdp2-launch); every other output is deleted once measured, as
# the GPU machine's disk (64 GB) holds the models, these and the FSDP checkpoints, not every conversion besides
LATER = {("llama-3.2-1b", k) for k in ("mqa", "gqa", "mla", "switchhead", "talking-heads")}


def discard(*folders: Path) -> None:
    import shutil

    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def numbers(tree, prefix: str = "") -> dict:
    """The numeric leaves of a JSON tree, flattened to dotted keys (lists and strings left out)."""
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out |= numbers(v, f"{prefix}{k}.")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        out[prefix[:-1]] = tree
    return out


def step_agree(ctx: Ctx) -> dict:
    """The aligned MQA conversion calibrated on the CPU and on the device, compared by `surgery check` (logits, KL,
    top-1), not by weights: eigh may flip eigenvector signs across devices."""
    layout = "llama-3.2-1b"
    # on the CPU run, the CPU equivalent: the same conversion twice (it must be deterministic)
    a = ctx.converted(layout, "aligned", "calib-cpu")
    b = ctx.converted(layout, "aligned", "calib-cpu-again" if ctx.cpu else f"calib-{ctx.device}")
    on_cpu = step_convert(ctx, layout, "aligned", device="cpu", dry_run=False, out=a, opts=AGREE[ctx.mode])
    on_dev = step_convert(ctx, layout, "aligned", device=ctx.device, dry_run=False, out=b, opts=AGREE[ctx.mode])
    report = ctx.work / "agree.json"
    c = CHECK[ctx.mode]
    surgery("check", a, b, "--json", report, "--data", "pydoc", "--tokens", c["tokens"], "--seq-len", c["seq_len"],
            "--batch-size", c["batch_size"], "--device", ctx.device, *precision_args("check"))
    discard(a, b)
    return dict(cpu_convert_s=on_cpu["seconds"], device_convert_s=on_dev["seconds"],
                **{f"check.{k}": v for k, v in numbers(json.loads(report.read_text())).items()})


def bandwidth(ctx: Ctx) -> float:
    """Measured memory bandwidth, bytes/s (read + write of a large copy), of the device the bench runs on."""
    torch = ctx.torch
    n = (1 << 30) if not ctx.cpu else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync = torch.cuda.synchronize if not ctx.cpu else (lambda: None)
    sync()
    start, count = time.perf_counter(), 0
    while count < 5 or time.perf_counter() - start < 0.2:
        b.copy_(a)
        count += 1
    sync()
    return 2 * n * count / (time.perf_counter() - start)


def step_bench(ctx: Ctx, kind: str) -> dict:
    """`surgery bench` of the source against one kind in bf16, and each decode's tokens/s against its HBM limit:
    batch / ((weight bytes + KV-cache bytes) / bandwidth)."""
    from safetensors import safe_open

    layout = "llama-3.2-1b"
    b = BENCH[ctx.mode]
    report = ctx.work / f"bench-{kind}.json"
    trust = ["--trust-remote-code"] if kind in ("talking-heads", "switchhead") else []
    surgery("bench", ctx.model(layout), ctx.converted(layout, kind), "--batch", b["batch"], "--context", b["context"],
            "--new", b["new"], "--rounds", b["rounds"], "--device", ctx.device, "--json", report,
            *precision_args("bench"), *trust)
    bw = bandwidth(ctx)
    weights = {}
    for role, folder in (("source", ctx.model(layout)), ("converted", ctx.converted(layout, kind))):
        total = 0
        for f in folder.glob("*.safetensors"):
            with safe_open(f, "pt") as sf:
                for key in sf.keys():
                    s = sf.get_slice(key)
                    total += math.prod(s.get_shape()) * 2  # bf16 bytes per element
        weights[role] = total
    if kind not in ("mqa", "gqa"):  # read again by fsdp2-launch and uptrain-kd
        discard(ctx.converted(layout, kind))
    figures = {"bandwidth_bytes_per_s": bw}
    for row in bench_rows(json.loads(report.read_text())):
        cell = f"b{row['batch']}.c{row['context']}"
        for role in ("source", "converted"):
            stats = row[role]
            decode, kv = stats.get("decode_tokens_per_s"), stats.get("kv_cache_bytes")
            figures[f"{cell}.{role}.decode_tok_s"] = decode
            figures[f"{cell}.{role}.prefill_tok_s"] = stats.get("prefill_tokens_per_s")
            figures[f"{cell}.{role}.kv_cache_bytes"] = kv
            if kv is not None:
                limit = row["batch"] * bw / (weights[role] + kv)
                figures[f"{cell}.{role}.decode_limit_tok_s"] = limit
                if decode is not None:
                    figures[f"{cell}.{role}.decode_of_limit"] = decode / limit
    return figures


def bench_rows(report: dict) -> list[dict]:
    """(batch, context, source medians, converted medians) per cell of a `surgery bench --json` report."""
    rows = []
    for r in report["results"]:
        rows.append(dict(batch=r["batch"], context=r["context"],
                         source={k: median(v) for k, v in r["source"].items()},
                         converted={k: median(v) for k, v in r["converted"].items()}))
    return rows


def median(v):
    return v.get("median") if isinstance(v, dict) else v


def step_uptrain(ctx: Ctx) -> dict:
    """KD uptraining of the 1B layout's GQA conversion (teacher: its source): tokens/s, MFU, peak memory against the
    dry-run estimate."""
    from surgery.memory_estimate import stats_from_folder, uptrain_memory

    layout = "llama-3.2-1b"
    u = UPTRAIN[ctx.mode]
    student, out = ctx.converted(layout, "gqa"), ctx.work / "uptrained"
    ctx.reset_peak()
    start = time.perf_counter()
    surgery("uptrain", student, "--out", out, "--force", "--data", "pydoc", "--loss", "kd", "--tokens", u["tokens"],
            "--seq-len", u["seq_len"], "--batch-tokens", u["batch_tokens"], "--micro-batch", u["micro_batch"],
            "--eval-tokens", 0, "--save-every", 0, "--warmup-steps", 1, "--progress-every", 3600,
            *precision_args("uptrain"))
    seconds = time.perf_counter() - start
    peak = ctx.peak()
    rows = [json.loads(line) for line in (out / "uptrain_metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r]
    rate = median_of([r["tokens_per_s"] for r in steps[1:] or steps])  # the first step warms up
    discard(out, out.with_name(out.name + ".run"))
    s, teacher = stats_from_folder(student), stats_from_folder(ctx.model(layout))
    flops_per_token = 6 * s.params + 2 * teacher.params  # student forward+backward, teacher forward
    peak_flops = device_peak_flops(ctx)
    options = argparse.Namespace(train="all", micro_batch=u["micro_batch"], seq_len=u["seq_len"],
                                 gradient_checkpointing=False, batch_tokens=u["batch_tokens"], hidden_weight=0)
    estimate = uptrain_memory(s, options, teacher, 1)
    return dict(seconds=seconds, steps=len(steps), tokens_per_s=rate, loss_first=steps[0]["loss"],
                loss_last=steps[-1]["loss"], mfu=rate * flops_per_token / peak_flops, peak_flops=peak_flops,
                estimate_bytes=estimate, **peak,
                peak_of_estimate=peak.get("peak_device_bytes", peak["peak_host_rss_bytes"]) / estimate)


def median_of(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2]


def device_peak_flops(ctx: Ctx) -> float:
    """The training's matmul peak: bf16 dense from the datasheet where the GPU is known, else a short matmul probe
    in the precision the training runs in (bf16 autocast on CUDA, fp32 on the CPU)."""
    torch = ctx.torch
    if not ctx.cpu:
        name = torch.cuda.get_device_name()
        for key, flops in PEAK_BF16.items():
            if key in name:
                return flops
    n, dtype = (512, torch.float32) if ctx.cpu else (8192, torch.bfloat16)
    a = torch.randn(n, n, dtype=dtype, device=ctx.device)
    sync = torch.cuda.synchronize if not ctx.cpu else (lambda: None)
    a @ a
    sync()
    start, count = time.perf_counter(), 0
    while count < 3 or time.perf_counter() - start < 0.3:
        a @ a
        count += 1
    sync()
    return 2 * n**3 * count / (time.perf_counter() - start)


def accelerate_config(ctx: Ctx) -> Path:
    """The FSDP2 accelerate config of the run: on the GPU one process over NCCL, bf16 mixed precision; on the CPU
    the shipped recipes/accelerate/fsdp-cpu.yaml (two processes over gloo)."""
    if ctx.cpu:
        return REPO / "recipes" / "accelerate" / "fsdp-cpu.yaml"
    path = ctx.work / "fsdp2-1gpu.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: bf16\n"
                    "machine_rank: 0\nnum_machines: 1\nnum_processes: 1\nrdzv_backend: static\nsame_network: true\n"
                    "use_cpu: false\nfsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                    "  fsdp_cpu_ram_efficient_loading: false\n  fsdp_offload_params: false\n"
                    "  fsdp_reshard_after_forward: true\n  fsdp_state_dict_type: FULL_STATE_DICT\n")
    return path


def launch(ctx: Ctx, args: list) -> str:
    """`accelerate launch` of ARGS with the run's FSDP2 config; its output (stdout and stderr)."""
    f = FSDP[ctx.mode]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config(ctx),
           "--num_processes", f["processes"], *map(str, args)]
    env = child_env() | {"OMP_NUM_THREADS": "1" if ctx.cpu else os.environ.get("OMP_NUM_THREADS", "4")}
    done = subprocess.run(list(map(str, cmd)), cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        lines = (done.stdout + done.stderr).strip().splitlines()
        tail = "\n".join([line for line in lines if "error:" in line][:3] + lines[-6:])
        raise RuntimeError(f"accelerate launch {' '.join(map(str, args[:3]))} exited {done.returncode}:\n{tail}")
    print(done.stdout[-2000:], done.stderr[-2000:], sep="\n")
    return done.stdout + done.stderr


def step_fsdp(ctx: Ctx) -> dict:
    """`accelerate launch` with an FSDP2 config (NCCL on the GPU, gloo on the CPU): three KD steps of the attention
    (`--train attention`: the global gradient norm over sharded and frozen parameters; small checkpoints) with a
    checkpoint after each; the output and the step-3 checkpoint removed, a resume from step 2 repeats step 3 (the weights
    against the uninterrupted run's); and the dtype of RoPE's inv_freq after `prepare` (fp32: bf16 corrupts
    positions)."""
    import shutil

    from safetensors.torch import load_file

    f = FSDP[ctx.mode]
    student, out = ctx.converted("llama-3.2-1b", "mqa"), ctx.work / "fsdp-out"
    args = ["-m", "surgery.cli", "uptrain", student, "--out", out, "--data", "pydoc", "--loss", "kd", "--tokens",
            3 * f["batch_tokens"], "--seq-len", f["seq_len"], "--batch-tokens", f["batch_tokens"], "--micro-batch",
            f["micro_batch"], "--eval-tokens", 0, "--save-every", 1, "--keep-run-dir", "--warmup-steps", 1, "--train", "attention",
            "--progress-every", 3600, "--force", *precision_args("uptrain")]
    start = time.perf_counter()
    launch(ctx, args)
    three = time.perf_counter() - start
    print(f"fsdp2-launch: three steps launched and saved in {three:.1f}s", flush=True)
    whole = {k: v.float() for f_ in sorted(out.glob("*.safetensors")) for k, v in load_file(f_).items()}
    shutil.rmtree(out)
    shutil.rmtree(out.with_name(out.name + ".run") / "checkpoints" / "step-00000003")
    start = time.perf_counter()
    log = launch(ctx, [*args, "--resume"])
    resumed = time.perf_counter() - start
    print(f"fsdp2-launch: the resume launched in {resumed:.1f}s", flush=True)
    if "resumed at step 2 from step-00000002" not in log:
        raise RuntimeError("the resume did not report resuming at step 2 from step-00000002")
    again = {k: v.float() for f_ in sorted(out.glob("*.safetensors")) for k, v in load_file(f_).items()}
    if again.keys() != whole.keys():
        raise RuntimeError(f"the resumed output holds other tensors: {sorted(again.keys() ^ whole.keys())[:4]}")
    probe = ctx.work / "probe"  # uptrain's own setup under the launch: the test suite's FSDP probe
    probe.mkdir(exist_ok=True)
    launch(ctx, ["-m", "surgery.testing.fsdp_probe", probe, PRECISION, student])
    found = json.loads((probe / "rank-0.json").read_text())
    inv_freq = {n: d for n, d in found["student"]["buffers"].items() if n.endswith("inv_freq")}
    if not inv_freq or set(inv_freq.values()) != {"float32"}:
        raise RuntimeError(f"inv_freq after prepare: {sorted(set(inv_freq.values()))} (want float32 only)")
    if not all(found["student"]["rotary_exact"].values()):
        raise RuntimeError("the rotary cos/sin tables after prepare differ from the checkpoint's: max abs diff "
                           f"{max(found['student']['rotary_max_abs_diff'].values()):.3g}")
    discard(out, out.with_name(out.name + ".run"), probe)
    return dict(three_steps_s=three, resume_s=resumed, resumed_at_step=2, processes=f["processes"],
                resumed_max_abs_dweight=max(float((again[k] - whole[k]).abs().max()) for k in whole),
                inv_freq_fp32=1, inv_freq_buffers=len(inv_freq), rotary_exact=1,
                distributed_type=found["distributed_type"], mixed_precision=found["mixed_precision"])


STEPS: dict[str, tuple] = {"build": (step_build,)}
STEPS |= {f"convert-1b-{k}": (step_convert, "llama-3.2-1b", k) for k in KINDS["gpu"]}
STEPS |= {f"bench-{k}": (step_bench, k) for k in BENCHED}
STEPS |= {"uptrain-kd": (step_uptrain,), "fsdp2-launch": (step_fsdp,)}
STEPS |= {f"convert-8b4l-{k}": (step_convert, "llama-3-8b-4l", k) for k in KINDS["gpu"]}
STEPS |= {"agree-cpu-device": (step_agree,)}  # last: its CPU half took 4.3 s a layer on the H100 machine's host


def step_device(ctx: Ctx) -> dict:
    """What the run ran on (CUDA initialised here, in a child, never in the driver that forks the steps)."""
    import torch
    import transformers

    info = dict(torch=torch.__version__, transformers=transformers.__version__, python=sys.version.split()[0],
                cpus=os.cpu_count(), device="cpu")
    if not ctx.cpu:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: run with --cpu")
        props = torch.cuda.get_device_properties(0)
        info |= dict(device=torch.cuda.get_device_name(), device_bytes=props.total_memory,
                     multiprocessors=props.multi_processor_count, bf16=int(torch.cuda.is_bf16_supported()))
    return info


STEPS = {"device": (step_device,)} | STEPS


def run_step(name: str, work: Path, cpu: bool) -> None:
    fn, *args = STEPS[name]
    ctx = Ctx(work, cpu)
    if cpu:  # tiny shapes: threads buy nothing, and on a shared machine they wait on each other
        ctx.torch.set_num_threads(1)
    figures = fn(ctx, *args)
    (work / "figures" / f"{name}.json").write_text(json.dumps(figures, default=str))


def child_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
