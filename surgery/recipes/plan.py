"""`surgery run RECIPE --dry-run`: the steps, their commands, what is already done, sizes, tokens, memory.

Nothing is downloaded, converted or written. The source is sized from disk when it is there (a local folder,
the hub cache, the dequantized GGUF cache), else from the recipe's `source.config`.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from ..errors import SurgeryError
from ..general_text import describe_texts
from ..units import human_bytes, human_count
from .. import memory_estimate as est
from .runner import (MODEL_STEPS, Fingerprints, State, check_recipe_output, command_line, is_done, launch_prefix,
                     plan_steps, step_range)
from .schema import Recipe


def local_source_folder(recipe: Recipe) -> Path | None:
    """The source's folder if it is already on disk; never downloads or dequantizes."""
    from ..checkpoint.source import HUB_PATTERNS, embedded_smollm2_gguf, gguf_cache_folder

    s = recipe.source
    if s.path:  # with `package`, the path is inside the package's folder (located without importing it)
        return Path(s.spec) if (Path(s.spec) / "config.json").exists() else None
    if s.gguf or s.id == "smollm2":
        try:
            gguf = Path(s.gguf) if s.gguf else embedded_smollm2_gguf()
        except SurgeryError:
            return None
        if not gguf.is_file():
            return None
        folder = gguf_cache_folder(gguf)
        return folder if (folder / "config.json").exists() else None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(s.id, revision=s.revision, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception:  # not in the cache (or no hub client): size it from source.config
        return None


def source_stats(recipe: Recipe, folder: Path | None) -> tuple[est.ModelStats | None, str]:
    if folder is not None:
        # pickle (.bin) weights are read only when the recipe's convert step allows them, as `surgery convert` does
        allow_pickle = any(s.kind == "convert" and s.options.allow_pickle for s in recipe.validated_steps())
        try:
            return est.stats_from_folder(folder, allow_pickle=allow_pickle), f"{folder}"
        except SurgeryError as e:
            if allow_pickle or "pickle" not in str(e):
                raise
            if not recipe.source.config:
                return None, f"{folder} holds only pickle weights (convert needs allow_pickle: true)"
    if recipe.source.config:
        path = recipe.relative(recipe.source.config)
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SurgeryError(f"source.config {path} cannot be read: {e}") from None
        try:
            return est.stats_from_config(config), f"not on disk; sized from {path}"
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise SurgeryError(f"source.config {path} does not describe a model transformers knows: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return None, "not on disk (add source.config to size the plan)"


def build_plan(recipe: Recipe, output: Path, from_step: str | None = None, until: str | None = None) -> dict:
    output = Path(output).absolute()
    planned = plan_steps(recipe, output)
    start, stop = step_range(planned, from_step, until)
    folder = local_source_folder(recipe)
    check_recipe_output(recipe, output, folder)  # as the run would refuse it (a source not on disk: the run checks)
    src_stats, src_note = source_stats(recipe, folder)
    state = State(output)
    fingerprints = Fingerprints(recipe, folder, planned)
    rows, stats = [], src_stats
    rewritten: set[Path] = set()  # outputs of the steps that will run: a later step reading one runs too
    probes: dict = {}
    for i, ps in enumerate(planned):
        o = ps.step.options
        command = shlex.join(command_line(recipe, ps))
        shown = os.path.relpath(output) if output.is_relative_to(Path.cwd()) else str(output)
        row = {"number": ps.number, "name": ps.name, "command": "surgery " + command.replace(str(output), shown)}
        if launch_prefix(recipe, ps):
            row["command"] = f"accelerate launch ({o.accelerate.num_processes} processes) " + row["command"]
        if i > stop:
            row["status"] = "not run (--until)"
        elif i < start:
            row["status"] = "done (before --from)"
        elif from_step is None and not ps.reads(rewritten) and is_done(state, ps, fingerprints):
            row["status"] = "done, unchanged: skip"
        else:
            row["status"] = "run"
            rewritten.add(ps.output)
        tokens = memory = None
        if ps.kind == "convert":
            memory = est.convert_memory(stats, o) if stats else None
            if o.kind.calibrates(o.kind_options):
                tokens = o.calib_tokens
                row["texts"] = describe_texts(o.kind_options.calib)
                if stats and stats.config is not None:
                    row["seconds_per_layer"] = _seconds_per_layer(stats, o, probes)
            stats = est.after_convert(stats, o) if stats else None
        elif ps.kind == "check":
            tokens = o.tokens * len(o.data)  # each text its own --tokens
            row["texts"] = describe_texts(o.data)
            memory = est.check_memory(stats, o) if stats else None
        elif ps.kind == "teacher":
            tokens = est.uptrain_tokens(o)  # the windows of the runs that read the store
            row["texts"] = describe_texts(o.data)
            row["store"] = store_row(o.top_k, tokens, made=False) | {"writes": True}
            if src_stats is not None:  # the teacher is the source
                device = teacher_device(o)
                per = est.teacher_pass_memory(src_stats, o, device=device)
                memory = per.device_peak if device == "cuda" else per.host_peak
                row["memory_per_process"] = {"device": per.device_type, "processes": 1, "host_main": per.host_peak,
                                             "device_main": per.device_peak, "lines": per.lines()}
        elif ps.kind == "uptrain":
            procs = o.accelerate.num_processes if o.accelerate else 1
            tokens = est.uptrain_tokens(o) + o.eval_tokens
            row["texts"] = describe_texts([*o.data, *([o.eval_data] if o.eval_data else [])])
            # a stored teacher pass stands for the teacher: no teacher model in memory
            distill = (o.loss in ("kd", "mix", "auto") or bool(getattr(o, "hidden_weight", 0))) and not o.teacher_logprobs
            if o.teacher_logprobs:
                row["store"] = uptrain_store_row(planned, ps, est.uptrain_tokens(o))
            memory = est.uptrain_memory(stats, o, src_stats if distill else None, procs) if stats else None
            if memory is not None and procs > 1:
                row["per_process"] = True
            if stats is not None:
                per = est.uptrain_memory_per_process(stats, o, src_stats if distill else None, procs,
                                                     device=uptrain_device(recipe, o))
                row["memory_per_process"] = {"device": per.device_type, "processes": per.processes,
                                             "host_main": per.host_peak, "device_main": per.device_peak,
                                             "host_other": per.host_peak_other, "device_other": per.device_peak_other,
                                             "lines": per.lines()}
        size = stats.bytes if (stats and ps.kind in MODEL_STEPS) else None
        row.update(tokens=tokens, memory=memory, size=row["store"]["bytes"] if ps.kind == "teacher" else size,
                   upload=stats.bytes if (stats and ps.kind == "push") else None)
        rows.append(row)
    return {"recipe": recipe.name or str(recipe.path), "source": recipe.source.spec, "revision": recipe.source.revision,
            "source_note": src_note, "source_params": src_stats.params if src_stats else None,
            "source_bytes": src_stats.bytes if src_stats else None, "output": str(output), "steps": rows,
            "hardware": recipe.hardware.model_dump(exclude_none=True) if recipe.hardware else None}


def store_row(top_k: int, tokens: int, made: bool, held: int | None = None) -> dict:
    """A stored teacher pass in the plan: top-K, its bytes per token (surgery/training/teacher_store.py) and its size
    for `tokens` tokens (`held`: the tokens a store already made holds)."""
    from ..training.teacher_store import bytes_per_token

    per = bytes_per_token(top_k)
    return {"top_k": top_k, "bytes_per_token": per, "tokens": tokens, "bytes": per * tokens, "made": made,
            "held": held}


def uptrain_store_row(planned: list, ps, tokens: int) -> dict:
    """The store an uptrain step reads: its teacher step's (K from the step), else a folder's (K from its manifest;
    the default --top-k when it is not made yet)."""
    from ..training.teacher_store import MANIFEST, read_manifest

    if ps.store is not None:
        step = next(p for p in planned if p.output == ps.store)
        return store_row(step.step.options.top_k, tokens, made=False) | {"step": step.name}
    folder = Path(ps.step.options.teacher_logprobs)
    if (folder / MANIFEST).is_file():
        m = read_manifest(folder)
        return store_row(m["top_k"], tokens, made=True, held=m["tokens"]) | {"folder": str(folder)}
    return store_row(32, tokens, made=False) | {"folder": str(folder)}


def teacher_device(options) -> str:
    """Where a teacher step runs: its --device (auto: CUDA when this machine has it)."""
    import torch

    device = str(getattr(options, "device", "auto") or "auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def store_lines(r: dict) -> list[str]:
    s = r["store"]
    size = f"{human_bytes(s['bytes'])} for {s['tokens']:,} tokens"
    if s.get("writes"):  # the teacher step
        return [f"  writes the store: top-{s['top_k']} at {s['bytes_per_token']} B/token (fp16 log-probs and int32 ids "
                f"per candidate, an fp16 tail) x {s['tokens']:,} tokens = {human_bytes(s['bytes'])}"]
    where = f"teacher step {s['step']}'s store" if "step" in s else f"store {s['folder']}"
    held = f"; it holds {s['held']:,} tokens" if s.get("held") is not None else ""
    return [f"  reads {where}: top-{s['top_k']} at {s['bytes_per_token']} B/token, {size}{held}",
            "  teacher: none in memory (the stored pass stands for it)"]


def uptrain_device(recipe: Recipe, options) -> str:
    """Where an uptrain step will run: its accelerate config's (`use_cpu`), else CUDA when this machine has it."""
    import torch

    launch = getattr(options, "accelerate", None)
    if launch is not None and launch.config_file:
        import yaml

        try:
            config = yaml.safe_load(recipe.relative(launch.config_file).read_text()) or {}
        except (OSError, yaml.YAMLError):
            config = {}
        return "cpu" if isinstance(config, dict) and config.get("use_cpu") else "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _seconds_per_layer(stats: est.ModelStats, options, probes: dict) -> float | None:
    """Seconds per layer of a calibrated conversion, from the cost model and a one-second probe of the step's device
    (None when that device is not on this machine)."""
    import torch

    from ..runtime import pick_device
    from ..estimate import probe_throughput

    try:
        device = pick_device(getattr(options, "device", "auto") or "auto")
    except SurgeryError:
        return None
    if str(device) not in probes:
        probes[str(device)] = probe_throughput(device) if device.type == "cpu" or torch.cuda.is_available() else None
    if probes[str(device)] is None:
        return None
    return est.streamed_calibration(stats, options, probes[str(device)]).seconds_per_layer


def print_plan(plan: dict) -> None:
    """The plan `surgery run --dry-run` asked for: the command's result, on stdout (printed, not logged: -q keeps it)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    src = plan["source"] + (f"@{plan['revision']}" if plan["revision"] else "")
    console.print(f"recipe [bold]{plan['recipe']}[/bold]: source {src} "
                  f"({human_count(plan['source_params'])} parameters, {human_bytes(plan['source_bytes'])}; "
                  f"{plan['source_note']})")
    console.print(f"output {plan['output']}")
    if plan["hardware"]:
        console.print("hardware: " + "; ".join(f"{k} {v}" for k, v in plan["hardware"].items()))
    table = Table(show_header=True)
    timed = any(r.get("seconds_per_layer") for r in plan["steps"])  # a column only when a step is calibrated
    for col in ("#", "step", "status", "tokens", "peak memory", *(["time/layer"] if timed else []), "writes"):
        table.add_column(col, justify="left" if col in ("step", "status") else "right")
    for r in plan["steps"]:
        memory = human_bytes(r["memory"]) + (" / process" if r.get("per_process") else "") if r["memory"] else "-"
        writes = human_bytes(r["size"]) if r["size"] else (f"uploads {human_bytes(r['upload'])}" if r["upload"] else "-")
        per_layer = f"{r['seconds_per_layer']:.1f} s" if r.get("seconds_per_layer") else "-"
        table.add_row(str(r["number"]), r["name"], r["status"], human_count(r["tokens"]) if r["tokens"] else "-",
                      memory, *([per_layer] if timed else []), writes)
    console.print(table)
    print("commands:")
    for r in plan["steps"]:
        print(f"  {r['number']}. {r['command']}")
    for r in plan["steps"]:
        if r.get("memory_per_process") or r.get("store"):
            print(f"{r['number']}. {r['name']}:")
            for line in (store_lines(r) if r.get("store") else []) + r.get("memory_per_process", {}).get("lines", []):
                print(line)
    if any(r.get("texts") for r in plan["steps"]):
        print("texts read:")
        for r in plan["steps"]:
            if r.get("texts"):
                print(f"  {r['number']}. {' + '.join(r['texts'])}")
    console.print("(dry run: nothing was run; memory, sizes and times are estimates, see surgery/memory_estimate.py "
                  "and surgery/estimate.py)")
