"""The parts of `surgery check`: what the first model leaves for the second (spill), greedy continuations
(generate), per-layer errors (layers), tokenizer agreement (tokenizers) and calibration overlap (overlap).
The command itself is `surgery.check`."""
