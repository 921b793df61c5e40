"""`surgery teacher SRC --data ... --tokens N --top-k K --out DIR`: one teacher pass over the training windows of a run,
stored (surgery/training/teacher_store.py) for `surgery uptrain --teacher-logprobs DIR`.

The windows are the run's own: the options are uptrain's data options (UptrainArgs), and the windows come from the
same data path (data.py packed, stream.py streamed) in the order a one-process run reads them (a packed store serves
any number of processes: its order is global). The teacher is loaded as uptrain loads a KD teacher
(model_io.load_causal_lm, in the compute precision) and runs under the same autocast.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Iterator

import torch

from ..version import __version__
from ..checkpoint.atomic import atomic_output_dir, check_output_path, local_inputs
from ..checkpoint.record import now, public_name, source_name
from ..checkpoint.source import resolve_source
from ..errors import SurgeryError
from ..logs import get_logger
from ..precision import resolve_precision
from ..progress import Progress
from ..runtime import pick_device
from . import model_io
from .options import UptrainOptions, resolve_data_workers
from .retrieval_mix import RetrievalMix, mixed
from .teacher_store import (StoreWriter, bytes_per_token, human_bytes, teacher_identity, tokenizer_identity,
                            window_hash, windows_spec)


def training_windows(o: UptrainOptions, tokenizer, workers: int, processes: int = 1) -> Iterator[torch.Tensor]:
    """The run's training windows in its global order, `o.micro_batch` at a time ([n, seq_len] int64), read by the
    data path uptrain uses with these options, --retrieval-mix's examples in (retrieval_mix.py). Streamed data: as a run of `processes` processes with `workers` data
    workers each reads it (each process streams its own windows), in the order of the store's windows: at each
    step, process 0's share of the step, then process 1's, ... (stored_kd.first_window). Packed data has one global
    order whatever the number of processes."""
    mix = RetrievalMix.of(o, tokenizer)
    first = 0
    for ids in _data_windows(o, tokenizer, workers, processes):
        yield mixed(mix, ids, first)
        first += ids.shape[0]


def _data_windows(o: UptrainOptions, tokenizer, workers: int, processes: int) -> Iterator[torch.Tensor]:
    """training_windows as the data path reads them, before any retrieval example goes in."""
    total = o.total_steps * o.sequences_per_step
    if o.streamed and o.skip_tokens:
        raise SurgeryError("--skip-tokens reads packed data: these options would stream it; use --data-mode packed")
    if o.streamed:
        from .stream import StreamedData
        from .stream_held_out import hold_out
        from .stream_packing import check_readers, early_check
        from .stream_sources import Plan, resolve_sources

        if o.sequences_per_step % processes:
            raise SurgeryError(f"--processes {processes} does not divide the {o.sequences_per_step} sequences of a step "
                               f"(--batch-tokens / --seq-len)")
        early_check(o.data, o.weights, processes * max(1, workers), text_field=o.text_field, streaming=o.streaming,
                    txt_unit=o.txt_unit)
        if workers:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        sources = resolve_sources(o.data, o.weights)
        args = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, seq_len=o.seq_len, seed=o.seed,
                    readers=processes * max(1, workers), epochs=o.data_epochs, text_field=o.text_field,
                    streaming=o.streaming, txt_unit=o.txt_unit, chat_template=o.chat_template)
        eval_windows, held = hold_out(args, sources, o.eval_tokens)
        plan = Plan(sources=tuple(sources), held=held, **args)
        check_readers(plan)
        streams = [StreamedData(plan, eval_windows, rank, processes, workers) for rank in range(processes)]
        share = o.sequences_per_step // processes
        try:
            for _ in range(o.total_steps):
                for data in streams:  # each process's share of the step, in rank order
                    for start in range(0, share, o.micro_batch):
                        yield data.take(min(o.micro_batch, share - start))
        finally:
            for data in streams:
                data.close()
        return
    from ..chat import ChatFormat
    from ..data import load_texts
    from .data import pack

    chat = ChatFormat(o.chat_template, tokenizer)  # conversations rendered as the run renders them
    data = pack(load_texts(o.data[0], o.text_field, o.streaming, o.txt_unit, chat), tokenizer, o.seq_len, o.eval_tokens,
                o.train_tokens, seed=o.seed, skip_tokens=o.skip_tokens)
    for start in range(0, total, o.micro_batch):
        yield data.train[data.window_indices(start, min(o.micro_batch, total - start))].long()


@torch.no_grad()
def top_k_of(logits: torch.Tensor, k: int, temperature: float = 1.0):
    """(log-probs [.., K] descending, their ids [.., K], log of the mass outside them [..]) of softmax(logits / T)."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    top, ids = z.topk(k, dim=-1)
    rest = torch.logsumexp(z.scatter(-1, ids, -math.inf), dim=-1)
    return top - lse, ids, rest - lse.squeeze(-1)


def check_stored(lp: torch.Tensor, ids: torch.Tensor, tail: torch.Tensor, vocab: int, temperature: float) -> None:
    """A window's top-K as the store will hold them (fp16) is a distribution (store_check.distribution_problem) before
    it is written: a teacher (or --temperature) that gives NaN log-probabilities is refused, nothing written."""
    from .store_check import distribution_problem

    problem = distribution_problem(lp.to(torch.float16), ids, tail.to(torch.float16), vocab)
    if problem is not None:
        raise SurgeryError(f"the teacher at --temperature {temperature:g} gives {problem}: no store was written")


def teacher_pass(src: str, out: Path, o: UptrainOptions, top_k: int, device: str = "auto",
                 trust_teacher_code: bool = False, progress: bool = True, revision: str | None = None,
                 processes: int = 1) -> dict:
    """Run the teacher `src` (at hub `revision`) over the training windows of a run with options `o` in `processes`
    processes and store its top-`top_k`; returns the manifest written into `out`."""
    if top_k < 1:
        raise SurgeryError(f"--top-k must be at least 1, got {top_k}")
    dev = pick_device(device)
    precision = resolve_precision(o.precision, dev)
    source = resolve_source(src, revision=revision)
    inputs = local_inputs("--data text", o.data)  # files and folders: --force never deletes what it reads
    check_output_path(out, o.force, source=source.folder, inputs=inputs)
    tokenizer = model_io.load_trusted_tokenizer(source, "teacher", trust_teacher_code)
    if tokenizer.eos_token_id is None:
        raise SurgeryError("the tokenizer has no EOS token to put between documents")
    RetrievalMix.of(o, tokenizer)  # --retrieval-mix with windows too short for its tasks: refused before the model loads
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # as uptrain's teacher_dtype
    model = model_io.load_causal_lm(source, "teacher", trust_teacher_code, dtype=dtype)
    vocab = model_io.vocab_size(model)
    if top_k > vocab:
        raise SurgeryError(f"--top-k {top_k} is more than the teacher's {vocab} logits")
    model_io.check_seq_len(model, o.seq_len, source.spec)
    model.requires_grad_(False)
    model.eval().to(dev)
    workers = resolve_data_workers(o.data_workers, dev.type)
    spec = windows_spec(o, tokenizer, processes * max(1, workers))
    total = o.total_steps * o.sequences_per_step
    fields = {"teacher": teacher_identity(source_name(source) or public_name(source.spec), source.folder),
              "tokenizer": tokenizer_identity(tokenizer), "vocab": vocab, "windows_spec": spec,
              "temperature": o.temperature, "precision": precision, "toolkit": {"name": "surgery",
                                                                                "version": __version__},
              "created": now()}
    started = time.perf_counter()
    with atomic_output_dir(out, force=o.force, source=source.folder) as tmp, \
            Progress(total, "teacher", unit="windows", enabled=progress) as bar:
        writer = StoreWriter(tmp, top_k, o.seq_len)
        for ids in training_windows(o, tokenizer, workers, processes):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = model(input_ids=ids.to(dev), use_cache=False).logits
            for i in range(ids.shape[0]):  # one window's [L, V] temporaries at a time
                lp, top_ids, tail = top_k_of(logits[i], top_k, o.temperature)
                check_stored(lp, top_ids, tail, vocab, o.temperature)
                writer.add(lp[None], top_ids[None], tail[None], window_hash(ids[i:i + 1]))
            del logits
            bar.update(ids.shape[0])
        manifest = writer.finish(fields | {"seconds": round(time.perf_counter() - started, 3)})
    get_logger(__name__).info(
        f"wrote {out}: top-{top_k} of {source.spec} on {manifest['tokens']:,} tokens ({manifest['windows']} windows "
        f"of {o.seq_len}), {bytes_per_token(top_k)} B/token, {human_bytes(bytes_per_token(top_k) * manifest['tokens'])}"
        f" in {len(manifest['shards'])} shard(s)")
    return manifest
