"""The data stage of an uptraining run (loop.py's `setup`): `setup_data` -> `Data` (recipe_setup.py, beside the
other stages' results), the training and held-out windows, packed up front (data.py) or streamed (stream.py), and
the key a resumed run must find again."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..checkpoint.sha256 import sha256_file
from ..errors import SurgeryError
from ..logs import get_logger
from .data import DATA_CACHE, cache_key, pack, pack_held_out, read_cache, write_cache
from .options import UptrainOptions
from .recipe_setup import Data, Run
from .run_folder import start_run_dir

if TYPE_CHECKING:
    from ..chat import ChatFormat

log = get_logger(__name__)


def tokens_trained_on(record: dict, data) -> int | None:
    """How far into the training split of text `data` the input model (its surgery.json `record`) was trained: its
    "uptraining" record's skipped plus trained tokens (a snapshot's: the tokens seen), when that record read `data`;
    else None."""
    up = record.get("uptraining")
    if not isinstance(up, dict) or up.get("data") != data or not isinstance(up.get("tokens"), int):
        return None
    skipped = up.get("skip_tokens", (up.get("run_options") or {}).get("skip_tokens", 0))
    return up["tokens"] + (skipped if isinstance(skipped, int) else 0)


def warn_rereading(o: UptrainOptions, record: dict) -> None:
    """One warning when the input was uptrained on this run's --data and no --skip-tokens is given: the run would
    read again the windows the input trained on."""
    seen = tokens_trained_on(record, o.data_spec)
    if seen and not o.skip_tokens and not o.resume:
        log.warning(f"the input model was trained on the first {seen} training tokens of this --data: this run "
                    f"reads them again; add --skip-tokens {seen} to train on fresh text")


def check_stream(o: UptrainOptions, world: int) -> None:
    """Streamed data that is empty, or has fewer documents than the `world` processes' readers: refused before the
    model loads."""
    if o.streamed and not o.resume:
        from .stream_packing import early_check

        early_check(o.data, o.weights, world * max(1, o.data_workers), text_field=o.text_field,
                    streaming=o.streaming, txt_unit=o.txt_unit)


def setup_data(o: UptrainOptions, run: Run, tokenizer: Any, chat: ChatFormat) -> Data:
    """The training and held-out windows: packed up front (small runs, data.py) or streamed (stream.py). A fresh run
    starts its run folder here, once the data proved good."""
    for flag, asked in (("--loss-on assistant", o.loss_on == "assistant"), ("--skip-tokens", bool(o.skip_tokens))):
        if asked and o.streamed:
            raise SurgeryError(f"{flag} reads packed data: this run would stream its data (several --data, "
                               "--data-workers, or more than --data-mode auto packs); use --data-mode packed")
    if not o.streamed:
        return _packed(o, run, tokenizer, chat)
    data = _streamed(o, run, tokenizer, chat)
    if run.main and not o.resume:
        start_run_dir(o, run.trajectory)
    run.acc.wait_for_everyone()
    return data


def packed_key(o: UptrainOptions, tokenizer: Any) -> str:
    """The key of the packed data cache (data.py's `read_cache`): what fixes the windows packed."""
    return cache_key(data=o.data_spec, text_field=o.text_field, **o.txt_key(), seq_len=o.seq_len,
                     eval_tokens=o.eval_tokens, **({"eval_data": o.eval_data} if o.eval_data is not None else {}),
                     train_tokens=o.train_tokens, vocab=len(tokenizer),
                     eos=tokenizer.eos_token_id, tokenizer=type(tokenizer).__name__, **_chat_key(o),
                     **({"skip_tokens": o.skip_tokens} if o.skip_tokens else {}))  # (other runs' keys unchanged)


def _packed(o: UptrainOptions, run: Run, tokenizer: Any, chat: ChatFormat) -> Data:
    """Packed training and held-out windows: the main process packs them and caches them for the others (and
    for resuming; the checkpoint records the cache's sha256, which a resumed run must find again)."""
    key = packed_key(o, tokenizer)

    def build():
        from ..data import load_texts

        data = pack(load_texts(o.data[0], o.text_field, o.streaming, o.txt_unit, chat), tokenizer, o.seq_len,
                    o.eval_tokens, o.train_tokens, seed=o.seed, masked=o.loss_on == "assistant",
                    skip_tokens=o.skip_tokens)
        if o.loss_on == "assistant" and not chat.read.get("conversations"):  # every token would count
            raise SurgeryError("--loss-on assistant: the data holds no conversation (no 'messages' column "
                               "read), so it has no assistant turns to train on; use --loss-on all")
        if o.loss_on == "assistant" and data.train_mask is not None and not data.train_mask[:, 1:].any():
            raise SurgeryError("--loss-on assistant: no conversation of the training data has an assistant turn "
                               "(nothing to train on); use --loss-on all")
        if o.eval_data is not None:
            data.other = pack_held_out(load_texts(o.eval_data, o.text_field, o.streaming, o.txt_unit, chat),
                                       tokenizer, o.seq_len, o.eval_tokens)
        return data

    cache = o.run_dir / DATA_CACHE
    with run.acc.main_process_first():
        data = read_cache(cache, key, o.seed) if (o.resume or not run.main) else None
        if data is None:
            data = build()
            if run.main:
                if not o.resume:
                    start_run_dir(o, run.trajectory)
                write_cache(cache, key, data)
    return Data(windows=data, key=key, sha256=sha256_file(cache))


def _streamed(o: UptrainOptions, run: Run, tokenizer: Any, chat: ChatFormat) -> Data:
    """Streamed training windows (read, tokenized and packed as the steps need them, by --data-workers); the
    held-out windows (the first documents of every source, and --eval-data) in memory."""
    from .stream import StreamedData, data_key
    from .stream_held_out import hold_out
    from .stream_packing import check_readers
    from .stream_sources import Plan, fingerprint, resolve_sources

    if "align" in o.stages and run.world > 1:
        raise SurgeryError("--stage align reads its windows in one process: with several processes use "
                           "--data-mode packed")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SurgeryError("the tokenizer has no EOS token to put between documents")
    if o.data_workers:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are forked from this process
    sources = resolve_sources(o.data, o.weights)
    args = dict(tokenizer=tokenizer, eos=eos, seq_len=o.seq_len, seed=o.seed,
                readers=run.world * max(1, o.data_workers), epochs=o.data_epochs, text_field=o.text_field,
                streaming=o.streaming, txt_unit=o.txt_unit, chat_template=o.chat_template)
    eval_windows, held = hold_out(args, sources, o.eval_tokens)
    plan = Plan(sources=tuple(sources), held=held, **args)
    if not o.resume:
        check_readers(plan)  # after the held-out documents, before the run folder is started
    data = StreamedData(plan, eval_windows, run.acc.process_index, run.world, o.data_workers)
    if o.eval_data is not None:
        from ..data import load_texts

        data.other = pack_held_out(load_texts(o.eval_data, o.text_field, o.streaming, o.txt_unit, chat),
                                   tokenizer, o.seq_len, o.eval_tokens)
    key = data_key({"sources": fingerprint(sources), **o.txt_key(), "seq_len": o.seq_len, "eval_tokens": o.eval_tokens,
                    "eval_data": o.eval_data, "seed": o.seed,
                    "vocab": len(tokenizer), "eos": eos, "tokenizer": type(tokenizer).__name__,
                    **_chat_key(o)})
    return Data(windows=data, key=key, sha256="")


def _chat_key(o: UptrainOptions) -> dict:
    """--chat-template for the data's key when it is not the default (other runs' keys stay as they were)."""
    return ({"chat_template": o.chat_template} if o.chat_template != "auto" else {}) | (
        {"loss_on": o.loss_on} if o.loss_on != "all" else {})
