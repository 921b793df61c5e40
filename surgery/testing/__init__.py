"""Builders that tests and benchmarks share (like `transformers.testing_utils`): tiny random checkpoints per family
with a character tokenizer (`tiny_models`), the tiny Llama with a pydoc-trained BPE tokenizer that uptraining is
measured on (`pydoc_llama`), and the aligned merge's held-out measure (`aligned`).

The package's top layer: it may import anything below it, and nothing in `surgery/` imports it (the layering test
in tests/test_registry.py holds both). Benchmarks import it as they import the rest of the installed package; the
tests' own plumbing (fixtures, CLI runners, the loopback hub) stays in tests/."""
