"""Checkpoint I/O: everything that reads or writes a checkpoint's files, below anything that runs a model.

Modules: `source` (resolving a folder, hub id, GGUF file or `smollm2` into a local folder; config.json as a dict),
`validate` (checks on checkpoints from strangers, run before anything is read in bulk), `tensors` (lazy safetensors
reading, streaming shard writing, the dtype table), `atomic` (outputs written in a temporary folder and renamed
into place), `record` (the `surgery.json` record), `sha256` (file hashes), `writer` (a converter's output folder:
shards, config, side files and record, in one atomic step).
"""
