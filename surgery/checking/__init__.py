"""`surgery check`: compare two checkpoints on the same tokens (compare), with its parts: what the first model
leaves for the second (spill), greedy continuations (generate), per-layer errors (layers), error by position in
the window (positions), tokenizer agreement (tokenizers), calibration overlap (overlap) and lm-eval tasks (tasks).
The command's options are `surgery.checking.options.CheckOptions`."""
