"""Uptraining: short continued training of a (converted) causal LM to win back quality.

`surgery uptrain DIR --data SPEC --tokens N --out OUT` runs `uptrain(UptrainOptions(...))`:

- `data.py`     documents -> tokens (EOS between) -> fixed-length windows; held-out split; per-step sharding.
- `stream.py`   the same, streamed for large budgets and mixtures: read and tokenized as the steps need them
  (its parts: `stream_sources.py`, `stream_held_out.py`, `stream_packing.py`, `stream_readers.py`).
- `losses.py`   next-token LM loss, KL distillation to a teacher (temperature), and their mix.
- `params.py`   which parameters train (`--train all|attention|new`).
- `model_io.py` loading the student and the teacher; writing the final checkpoint and its surgery.json.
- `state.py`    atomic accelerate checkpoints (model, optimizer, RNG, data position), last K kept, resume.
- `metrics.py`  metrics.jsonl; `plot.py` the PNG of loss and perplexity against tokens.
- `loop.py`     the training loop on accelerate (CPU, one GPU, or `accelerate launch` with DDP/FSDP/DeepSpeed):
  `setup` runs the setup stages in order, each a function of what the earlier ones returned, and builds the
  `UptrainRecipe` (`train`, `save`) from their results.
- `recipe_setup.py`, `recipe_data.py` the setup stages, each returning a small frozen dataclass: `Inputs` (source,
  record, objective), `Run` (accelerator, processes, batch split), `Models`, `Data` (the windows and their key),
  `Training` (optimizer, trainable parameters, run state, metrics, resumed checkpoint), `Heads`.
- `accelerator.py` accelerate's Accelerator: precision, DDP or FSDP2, how the models are read under it.
- `optimizer.py` AdamW and the learning-rate schedule; `evaluation.py` held-out loss and perplexity.
- `run_folder.py` the run folder checked and started; `finite.py` the stop at a number that is not finite.
- `output.py`   the final write-out: checkpoint, surgery.json's "uptraining" record, metrics and plot.
- `snapshot.py` one kept checkpoint of a run (`--keep-run-dir`) written as the output would have been at that step.

Contract with the converters: `surgery.json` may list the parameters a conversion introduced, which is what
`--train new` trains (and `--train attention` trains on top of the attention projections):

    "new_parameters": ["model.layers.*.self_attn.logits_mix", "model.layers.*.self_attn.router.*"]

Each entry is a shell-style pattern (`fnmatch`, case-sensitive; `*` also crosses dots) over the parameter names of
the model as `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True).named_parameters()` yields them. A
pattern matches a name when it matches the whole name or a suffix of it that starts right after a dot, so the
`model.` prefix may be left out (`layers.*.self_attn.logits_mix` works too), and checkpoint tensor names work for
architectures whose in-memory names equal them. A `{layer}` placeholder is read as `*`. Every pattern must match at
least one parameter, else the run stops with an error. A record without the key (or with an empty list) means the
conversion added nothing trainable of its own (MQA/GQA pooling), and `--train new` is refused.
"""

from .options import UptrainOptions

__all__ = ["UptrainOptions", "uptrain"]


def uptrain(options: UptrainOptions) -> dict:
    """Run (or resume) one uptraining run; returns the uptraining record written into OUT/surgery.json."""
    from .loop import run

    return run(options)
