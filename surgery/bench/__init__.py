"""`surgery bench`: measured speed and memory of a converted checkpoint against its source, in one run.

Both models are loaded once into this process, warmed up, and then measured in alternating rounds (source first in
even rounds, converted first in odd ones) for every batch x context, so that whatever else runs on the machine hits
both alike. Each measurement: a prefill of `batch x context` random tokens (the same for both models) that fills
a fresh KV cache, then `new` single-token decode steps on that cache. Recorded per round: prefill seconds, decode
seconds per step, the bytes of the KV cache after the prefill, and the peak memory of the prefill + decode
(CUDA: torch.cuda.max_memory_allocated above what was allocated before; CPU: the kernel's peak RSS (VmHWM, reset
through /proc/self/clear_refs) above the RSS before — Linux only, None elsewhere). The report keeps every raw
round; medians, min/max and the converted/source ratios of the medians are computed from them.

- `options.py`             BenchOptions and the refusals checked before anything is loaded (engine, lists, flash
  attention, torch.compile, whose code each trust flag trusts).
- `measure.py`             memory free and needed, peak memory, and seconds between device synchronizations.
- `transformers_engine.py` the transformers engine (sdpa, or a converted checkpoint's own code).
- `llama_cpp_engine.py`    the llama.cpp engine on GGUF files; their KV cache counted from the metadata.
- `vllm_engine.py`         the vLLM engine; its KV cache counted from the config by the kind that wrote it.
- `stats.py`               each round's metrics; medians, spread and converted / source ratios.
- `run.py`                 `run_bench`: the engine the options pick, the alternating rounds, the report.
- `report.py`              the report for people: the terminal table, the Markdown table, the plot.
"""
