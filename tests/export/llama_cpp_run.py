"""llama.cpp itself on an exported GGUF file, through llama-cpp-py-sync (a prebuilt CPU build of llama.cpp on PyPI,
CFFI bindings of its C API): every position's logits of a token sequence, with f32 weights as written, an f32 K/V
cache, no flash attention and a sliding-window cache of window + one micro-batch (`swa_full` off, what llama.cpp's
own tools do with --swa-full off), and the lines llama.cpp logged (its KV cache sizes among them). The tests that use
it skip where the package is missing or its library does not load (its wheels need glibc 2.38)."""

from __future__ import annotations


import numpy as np
import pytest

GGML_TYPE_F32 = 0


def llama_cpp_loads() -> bool:
    """Whether llama-cpp-py-sync is installed and its shared library loads (its wheels need glibc 2.38)."""
    try:
        from llama_cpp_py_sync._cffi_bindings import get_lib

        get_lib()
        return True
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError when the shared library does not load
        return False


def llama_cpp_library():
    """(lib, ffi) of llama-cpp-py-sync, or skip the test."""
    try:
        from llama_cpp_py_sync._cffi_bindings import get_ffi, get_lib

        return get_lib(), get_ffi()
    except Exception as e:  # noqa: BLE001 - ImportError, or RuntimeError when the shared library does not load
        pytest.skip(f"needs llama-cpp-py-sync, a prebuilt llama.cpp, loadable here: {str(e).splitlines()[0][:200]}")


def llama_cpp_logits(gguf_file, ids: list[int], batch: int = 256, threads: int = 2) -> tuple[np.ndarray, list[str]]:
    """(logits at every position of `ids`, [len(ids), vocab], float32; llama.cpp's log lines)."""
    lib, ffi = llama_cpp_library()
    lines: list[str] = []

    @ffi.callback("ggml_log_callback")
    def log(level, text, data):
        lines.append(ffi.string(text).decode(errors="replace"))

    lib.llama_log_set(log, ffi.NULL)
    lib.llama_backend_init()
    model = ctx = None
    try:
        model = lib.llama_model_load_from_file(str(gguf_file).encode(), lib.llama_model_default_params())
        assert model != ffi.NULL, "llama.cpp did not load the file: " + "".join(lines[-4:])
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = len(ids), batch, batch
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = GGML_TYPE_F32
        params.flash_attn_type = 0
        params.swa_full = False
        ctx = lib.llama_init_from_model(model, params)
        assert ctx != ffi.NULL, "llama.cpp made no context: " + "".join(lines[-4:])
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        out = np.empty((len(ids), n_vocab), dtype=np.float32)
        for start in range(0, len(ids), batch):
            chunk = ids[start:start + batch]
            b = lib.llama_batch_init(len(chunk), 0, 1)
            try:
                b.n_tokens = len(chunk)
                for i, token in enumerate(chunk):
                    b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, start + i, 1, 1
                    b.seq_id[i][0] = 0
                assert lib.llama_decode(ctx, b) == 0, "".join(lines[-4:])
                for i in range(len(chunk)):
                    row = lib.llama_get_logits_ith(ctx, i)
                    out[start + i] = np.frombuffer(ffi.buffer(row, n_vocab * 4), dtype=np.float32)
            finally:
                lib.llama_batch_free(b)
        return out, lines
    finally:
        if ctx is not None and ctx != ffi.NULL:
            lib.llama_free(ctx)
        if model is not None and model != ffi.NULL:
            lib.llama_model_free(model)
        lib.llama_log_set(ffi.NULL, ffi.NULL)
