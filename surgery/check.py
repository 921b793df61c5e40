"""Compare two checkpoints on the same tokens: |Δlogits|, KL(source‖converted), top-1 agreement, perplexity.

Causal LMs are compared on their logits; encoders (no causal LM head) on their last hidden states.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F

from .data import token_stream
from .errors import SurgeryError
from .source import Source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-1}


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SurgeryError(f"--device {device}: CUDA is not available on this machine")
    try:
        return torch.device(device)
    except RuntimeError:
        raise SurgeryError(f"bad device {device!r}") from None


def is_causal_lm(config) -> bool:
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))


def load_model(source: Source, device: torch.device, dtype: str, trust_remote_code: bool = False,
               attn_implementation: str | None = None):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        config = AutoConfig.from_pretrained(source.folder, trust_remote_code=trust_remote_code)
        auto = AutoModelForCausalLM if is_causal_lm(config) else AutoModel
        model = auto.from_pretrained(source.folder, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, **extra)
    except (OSError, ValueError) as e:
        raise SurgeryError(f"cannot load {source.spec}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval()


def load_tokenizer(source: Source, trust_remote_code: bool = False):
    """The source's tokenizer. transformers reads the folder's config on the way: for a folder with its own modeling
    code it runs that code with `trust_remote_code`, and without it would stop to ask on the terminal."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise SurgeryError(f"cannot load the tokenizer of {source.spec}: {str(e).splitlines()[0]}") from None


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = ids.numel() // seq_len
    if n == 0:
        raise SurgeryError(f"need at least {seq_len} tokens, the data gave {ids.numel()}")
    return ids[: n * seq_len].view(n, seq_len)


def context_length(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


class Accumulator:
    """Running sums for the comparison metrics, batch after batch."""

    def __init__(self):
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.n_values = 0
        self.kl = 0.0
        self.agree = 0
        self.n_positions = 0
        self.nll = [0.0, 0.0]
        self.n_targets = 0

    def add_outputs(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a, b = a.float(), b.float()
        diff = (a - b).abs()
        self.max_abs = max(self.max_abs, diff.max().item())
        self.sum_abs += diff.sum().item()
        self.n_values += diff.numel()

    def add_logits(self, a: torch.Tensor, b: torch.Tensor, input_ids: torch.Tensor) -> None:
        self.add_outputs(a, b)
        logp_a, logp_b = F.log_softmax(a.float(), -1), F.log_softmax(b.float(), -1)
        self.kl += (logp_a.exp() * (logp_a - logp_b)).sum(-1).sum().item()
        self.agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        self.n_positions += a.shape[0] * a.shape[1]
        targets = input_ids[:, 1:].reshape(-1)
        for i, logp in enumerate((logp_a, logp_b)):
            self.nll[i] += F.nll_loss(logp[:, :-1].reshape(-1, logp.shape[-1]), targets, reduction="sum").item()
        self.n_targets += targets.numel()

    def report(self) -> dict:
        out = {"max_abs_diff": self.max_abs, "mean_abs_diff": self.sum_abs / max(self.n_values, 1)}
        if self.n_positions:
            out.update(
                kl=self.kl / self.n_positions,
                top1_agreement=self.agree / self.n_positions,
                ppl_source=math.exp(self.nll[0] / self.n_targets),
                ppl_converted=math.exp(self.nll[1] / self.n_targets),
            )
        return out


@torch.no_grad()
def compare_models(model_a, model_b, ids: torch.Tensor, seq_len: int, batch_size: int, causal: bool) -> dict:
    device = next(model_a.parameters()).device
    batches = windows(ids, seq_len)
    acc = Accumulator()
    for start in range(0, batches.shape[0], batch_size):
        x = batches[start : start + batch_size].to(device)
        if causal:
            acc.add_logits(model_a(input_ids=x).logits, model_b(input_ids=x).logits, x)
        else:
            acc.add_outputs(model_a(input_ids=x).last_hidden_state, model_b(input_ids=x).last_hidden_state)
    return acc.report() | {"tokens": batches.numel(), "windows": batches.shape[0], "seq_len": seq_len,
                           "compared": "logits" if causal else "last_hidden_state"}


def compare_checkpoints(source: Source, converted: Source, texts: Iterable[str], tokens: int = 16384,
                        seq_len: int = 1024, batch_size: int = 4, device: str = "auto", dtype: str = "float32",
                        trust_remote_code: bool = False) -> dict:
    dev = pick_device(device)
    tokenizer = load_tokenizer(source)
    # A talking-heads model computes eager attention: compare it with the source's eager attention, so that the
    # report measures the surgery and not the source's own sdpa-vs-eager rounding (~1e-4 on SmolLM2's logits).
    source_attn = "eager" if surgery_kind(converted) == "talking-heads" else None
    if source_attn and not trust_remote_code:
        raise SurgeryError(f"{converted.spec} is a talking-heads checkpoint with its own modeling code: "
                           "pass --trust-remote-code to run it")
    model_a = load_model(source, dev, dtype, trust_remote_code, attn_implementation=source_attn)
    model_b = load_model(converted, dev, dtype, trust_remote_code)
    if model_a.config.vocab_size != model_b.config.vocab_size:
        raise SurgeryError("the two checkpoints have different vocabularies")
    ctx = context_length(model_a.config)
    seq_len = min(seq_len, ctx) if ctx else seq_len
    causal = is_causal_lm(model_a.config)
    ids = token_stream(texts, tokenizer, tokens)
    return compare_models(model_a, model_b, ids, seq_len, batch_size, causal) | {
        "device": str(dev), "dtype": dtype, "source_attention": model_a.config._attn_implementation}


def surgery_kind(source: Source) -> str | None:
    """The `kind` recorded in a checkpoint's surgery.json, if it has one."""
    import json
    from pathlib import Path

    record = Path(source.folder) / "surgery.json"
    try:
        return json.loads(record.read_text()).get("kind") if record.exists() else None
    except (OSError, ValueError):
        return None


def print_report(report: dict, title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("compared", report.get("compared")),
        ("tokens", report.get("tokens")),
        ("max |Δ|", f"{report['max_abs_diff']:.3e}"),
        ("mean |Δ|", f"{report['mean_abs_diff']:.3e}"),
    ]
    if "kl" in report:
        rows += [
            ("KL(source‖converted) / token", f"{report['kl']:.4g}"),
            ("top-1 agreement", f"{100 * report['top1_agreement']:.2f}%"),
            ("perplexity, source", f"{report['ppl_source']:.3f}"),
            ("perplexity, converted", f"{report['ppl_converted']:.3f}"),
        ]
    if "exact" in report:
        rows.append(("exact (tolerance)", f"{'yes' if report['exact'] else 'no'} ({report['tolerance']:g})"))
    for name, value in rows:
        table.add_row(name, str(value))
    Console().print(table)
