"""Decode speed in llama.cpp with and without flash attention, the GGUF files alternated (needs llama-cpp-python).

    python benchmarks/bench_llama_cpp_flash.py --context 8192 --tokenizer SMOLLM2_FOLDER source-f32.gguf mla-f32.gguf

`surgery bench --engine llama.cpp` builds llama-cpp-python's `Llama` with its default `flash_attn=False`; an MLA file
decodes much faster with it on (BENCHMARKS.md, "MLA in llama.cpp"). Each file: prefill `--context` tokens of pydoc,
then `--new` single decode steps, timed; tokens/s printed per file, setting and round.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    import llama_cpp
    from transformers import AutoTokenizer

    from surgery.data import pydoc_texts, token_stream

    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokenizer", required=True, help="a folder with the models' tokenizer")
    a = p.parse_args()
    ids = token_stream(pydoc_texts(), AutoTokenizer.from_pretrained(a.tokenizer), a.context + a.new).tolist()
    for flash in (False, True):
        for rnd in range(a.rounds):
            for f in a.files:
                llm = llama_cpp.Llama(model_path=f, n_ctx=a.context + 64, n_batch=512, n_ubatch=512,
                                      n_threads=a.threads, n_threads_batch=a.threads, flash_attn=flash, verbose=False)
                llm.eval(ids[:a.context])
                start = time.perf_counter()
                for token in ids[a.context:a.context + a.new]:
                    llm.eval([token])
                print(f"flash_attn={flash} round {rnd} {f}: {a.new / (time.perf_counter() - start):.2f} tok/s",
                      flush=True)
                del llm


if __name__ == "__main__":
    main()
