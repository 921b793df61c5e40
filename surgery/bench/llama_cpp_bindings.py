"""The Python bindings of llama.cpp that `surgery bench --engine llama.cpp` drives, behind one small interface: load a
GGUF file into a context of n_ctx cells, `eval` tokens (the KV cache grows), `reset` it, `n_vocab`, `close`.

Two bindings, the first one that is installed and loads wins:
- llama-cpp-python (`llama_cpp`): its `Llama` class (built from source on install, minutes of C++);
- llama-cpp-py-sync (`llama_cpp_py_sync`): CFFI bindings of llama.cpp's C API over a prebuilt CPU build (its Linux
  wheels need glibc 2.38); driven here through the C API itself (model, context, batches), and its log read for the
  KV cache llama.cpp allocates.
Neither installed, or none that loads: one line naming what is missing or why it does not load.
"""

from __future__ import annotations

import re
from importlib.util import find_spec
from pathlib import Path

from ..errors import SurgeryError

# (module, package on PyPI), in the order they are tried
BINDINGS = (("llama_cpp", "llama-cpp-python"), ("llama_cpp_py_sync", "llama-cpp-py-sync"))
N_BATCH = 512  # tokens per llama_decode call and per micro-batch (n_batch = n_ubatch), both bindings
FLASH_ATTN_DISABLED, FLASH_ATTN_ENABLED = 0, 1  # llama.cpp's enum llama_flash_attn_type


def _load_problem(module: str) -> str | None:
    """Why an installed binding does not load (its first line), or None when it does."""
    try:
        if module == "llama_cpp_py_sync":
            from llama_cpp_py_sync._cffi_bindings import get_lib

            get_lib()  # the shared library: a wheel built for a newer glibc fails here, not at import
        else:
            __import__(module)
    except Exception as e:  # noqa: BLE001 - ImportError, OSError, RuntimeError: all mean "does not load"
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return None


def pick_binding() -> str:
    """The module of the first binding in BINDINGS that is installed and loads; else one line (SurgeryError)."""
    problems = []
    for module, package in BINDINGS:
        if find_spec(module) is None:
            continue
        why = _load_problem(module)
        if why is None:
            return module
        problems.append(f"{package} is installed but does not load ({why})")
    if problems:
        raise SurgeryError(f"--engine llama.cpp: {'; '.join(problems)}")
    names = " or ".join(package for _, package in BINDINGS)
    raise SurgeryError(f"--engine llama.cpp needs {names}, and neither is installed (pip install llama-cpp-py-sync: "
                       f"a prebuilt CPU llama.cpp; llama-cpp-python builds llama.cpp from source)")


def open_model(module: str, path: Path, n_ctx: int, threads: int, gpu_layers: int, flash_attn: bool):
    """`path` loaded by the binding `module` into a context of `n_ctx` cells (f16 K/V cache, llama.cpp's default)."""
    if module == "llama_cpp":
        return LlamaCppPython(path, n_ctx, threads, gpu_layers, flash_attn)
    return LlamaCppPySync(path, n_ctx, threads, gpu_layers, flash_attn)


class LlamaCppPython:
    """llama-cpp-python's `Llama` (quiet: its log, the KV cache lines included, is not read)."""

    def __init__(self, path: Path, n_ctx: int, threads: int, gpu_layers: int, flash_attn: bool):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH,
                                   n_threads=threads, n_threads_batch=threads, n_gpu_layers=gpu_layers,
                                   flash_attn=flash_attn, logits_all=False, verbose=False)
        # what the context was built with (read back from it, not from the option)
        self.flash_attn = self.llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.binding = f"llama-cpp-python {llama_cpp.__version__}"
        self.kv_cache = None

    def n_vocab(self) -> int:
        return int(self.llm.n_vocab())

    def reset(self) -> None:
        self.llm.reset()

    def eval(self, tokens: list[int]) -> None:
        self.llm.eval(tokens)

    def close(self) -> None:
        self.llm = None


class LlamaCppPySync:
    """llama.cpp's C API through llama-cpp-py-sync's CFFI bindings: one sequence, logits of the last token of each
    `eval` only; llama.cpp's log is read while the context is made, for the KV cache it allocates. Sliding-window
    layers keep W + n_ubatch cells (`swa_full` off, the default of llama.cpp's CLI and server; the C API's own
    default keeps a full-size cache for them)."""

    def __init__(self, path: Path, n_ctx: int, threads: int, gpu_layers: int, flash_attn: bool):
        import llama_cpp_py_sync
        from llama_cpp_py_sync._cffi_bindings import get_ffi, get_lib

        self.lib, self.ffi = lib, ffi = get_lib(), get_ffi()
        self.binding = f"llama-cpp-py-sync {llama_cpp_py_sync.__version__}, llama.cpp {llama_cpp_py_sync.__llama_cpp_tag__}"
        lines: list[str] = []

        @ffi.callback("ggml_log_callback")
        def log(level, text, data):
            lines.append(ffi.string(text).decode(errors="replace"))

        lib.llama_log_set(log, ffi.NULL)
        lib.llama_backend_init()
        self.model = self.ctx = None
        try:
            params = lib.llama_model_default_params()
            params.n_gpu_layers = gpu_layers
            self.model = lib.llama_model_load_from_file(str(path).encode(), params)
            if self.model == ffi.NULL:
                raise SurgeryError(f"llama.cpp did not load {path}: {_last_error(lines)}")
            c = lib.llama_context_default_params()
            c.n_ctx, c.n_batch, c.n_ubatch, c.n_seq_max = n_ctx, N_BATCH, N_BATCH, 1
            c.n_threads = c.n_threads_batch = threads
            c.flash_attn_type = FLASH_ATTN_ENABLED if flash_attn else FLASH_ATTN_DISABLED
            c.swa_full = False  # sliding layers keep their window (+ one micro-batch), as llama.cpp's own tools do
            self.ctx = lib.llama_init_from_model(self.model, c)
            if self.ctx == ffi.NULL:
                raise SurgeryError(f"llama.cpp made no context of {n_ctx} tokens for {path}: {_last_error(lines)}")
        except BaseException:
            self.close()
            raise
        finally:
            lib.llama_log_set(_quiet(ffi), ffi.NULL)  # not NULL: that is llama.cpp's own logger, on stderr
        self.flash_attn = flash_attn
        self.kv_cache = kv_cache_lines(lines)
        self.n_past = 0

    def n_vocab(self) -> int:
        return int(self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model)))

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def eval(self, tokens: list[int]) -> None:
        lib = self.lib
        for start in range(0, len(tokens), N_BATCH):
            chunk = tokens[start:start + N_BATCH]
            batch = lib.llama_batch_init(len(chunk), 0, 1)
            try:
                batch.n_tokens = len(chunk)
                for i, token in enumerate(chunk):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, self.n_past + i, 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = i == len(chunk) - 1 and start + len(chunk) == len(tokens)
                code = lib.llama_decode(self.ctx, batch)
                if code != 0:
                    raise SurgeryError(f"llama.cpp's llama_decode returned {code} at position {self.n_past}")
                self.n_past += len(chunk)
            finally:
                lib.llama_batch_free(batch)

    def close(self) -> None:
        if self.ctx is not None and self.ctx != self.ffi.NULL:
            self.lib.llama_free(self.ctx)
        if self.model is not None and self.model != self.ffi.NULL:
            self.lib.llama_model_free(self.model)
        self.ctx = self.model = None


_QUIET = []  # the one silent log callback, kept alive as long as llama.cpp may call it


def _quiet(ffi):
    if not _QUIET:
        _QUIET.append(ffi.callback("ggml_log_callback")(lambda level, text, data: None))
    return _QUIET[0]


def _last_error(lines: list[str]) -> str:
    return " ".join("".join(lines[-3:]).split())[-300:] or "no message"


KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?K \((\w+)\): +([\d.]+) MiB"
                     r"(?:, V \((\w+)\): +([\d.]+) MiB)?")
# a hybrid's mixer state: R the convolution's last inputs, S the SSM state (f32, fixed whatever the context)
STATE_LINE = re.compile(r"llama_memory_recurrent: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?"
                        r"R \((\w+)\): +([\d.]+) MiB, S \((\w+)\): +([\d.]+) MiB")


def kv_cache_lines(lines: list[str]) -> list[dict]:
    """The KV caches llama.cpp logged when it made a context, one per kind of layer (a sliding-window model: the
    full layers' cache, then the sliding layers'), and a hybrid's recurrent mixer state (`"state": True`, R and S
    in the k/v fields): [{"mib", "cells", "layers", "type_k", "k_mib", "v_mib"}]."""
    found = []
    for line in "".join(lines).splitlines():
        if m := KV_LINE.search(line):
            found.append({"mib": float(m[1]), "cells": int(m[2]), "layers": int(m[3]), "type_k": m[4],
                          "k_mib": float(m[5]), "v_mib": float(m[7] or 0)})
        elif m := STATE_LINE.search(line):
            found.append({"mib": float(m[1]), "cells": int(m[2]), "layers": int(m[3]), "type_k": m[4],
                          "k_mib": float(m[5]), "v_mib": float(m[7]), "state": True})
    return found
