"""`surgery export CHECKPOINT --gguf OUT.gguf`: a checkpoint of this toolkit (or one of its sources) written as a
GGUF file that llama.cpp runs with the same function, with gguf-py alone (no llama.cpp sources).

One module per GGUF architecture: `llama` (Llama-bodied sources and their MQA/GQA outputs; `swa` outputs as
`granite_swa`, the llama.cpp architecture that carries a per-layer sliding-window pattern), `qwen` (Qwen2 and Qwen3
bodies, sources and MQA/GQA outputs, as `qwen2` and `qwen3`), `deepseek2` (MLA
outputs), `granitehybrid` (hybrid outputs: `bamba`, attention and Mamba-2 layers). `plan` picks the module from the
config and refuses, in one line, whatever none of them represents exactly; `tokenizer` writes the vocabulary;
`gguf_file` streams the tensors into a temporary file, one at a time, and renames it into place when it is complete.
"""
