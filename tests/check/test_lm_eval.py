"""Converted checkpoints under lm-evaluation-harness: `HFLM` loads each output folder (standard MQA/GQA, talking-heads
and SwitchHead with their own modeling code) and scores loglikelihood requests built here, offline.

Needs the `eval` extra (`pip install -e '.[eval]'`); skipped without it. Slow: run with `python -m pytest -m slow`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from surgery.testing import tiny_models as tm
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import GQAOptions, MQAOptions
from surgery.checkpoint.source import resolve_source
from surgery.switchhead import convert_to_switchhead
from surgery.switchhead.options import SwitchHeadOptions
from surgery.talking_heads import convert_to_talking_heads
from surgery.talking_heads.options import TalkingHeadsOptions
from surgery.testing.tiny_models import char_tokenizer

pytestmark = pytest.mark.slow

ARCHS = ["llama", "gpt2"]  # llama: 8 query heads over 4 K/V heads; gpt2: fused c_attn, 4 heads
TOL = 1e-4
PAIRS = [  # (context, continuation); the empty context is scored after lm_eval's prefix (EOS) token
    ("The quick brown fox", " jumps over the lazy dog."),
    ("def f(x):", " return x + 1"),
    ("", "Hello"),
    ("x = [1, 2, 3]", "\nprint(x)"),
    ("a" * 40, "b" * 10),
]
# longer than the tiny models' 128-token context: lm_eval scores it in rolling windows
ROLLING = "Attention surgery rewrites the attention of a pretrained checkpoint. " * 5


def char_of(token: int) -> str:
    """The text of one id of `char_tokenizer`: id i >= 1 is chr(31 + i), id 0 is EOS."""
    assert token >= 1
    return chr(31 + token)


def hflm(folder: Path):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(folder), trust_remote_code=True, device="cpu", batch_size=2, dtype="float32")


def greedy_pair(folder: Path, steps: int = 5) -> tuple[str, str]:
    """A (context, continuation) whose continuation is the model's own greedy output, so that is_greedy is True."""
    model = tm.load(folder)
    for context in ("Once upon a time", "import torch", "Hello, world", "1, 2, 3, 4"):
        ids = torch.tensor([[ord(c) - 31 for c in context]])
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        if 0 not in out:  # EOS has no text of its own
            return context, "".join(char_of(t) for t in out)
    raise AssertionError("no greedy continuation without EOS")


def score(lm, pairs) -> list[tuple[float, bool]]:
    from lm_eval.api.instance import Instance

    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    return lm.loglikelihood(requests, disable_tqdm=True)


def rolling(lm) -> float:
    from lm_eval.api.instance import Instance

    [total] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ROLLING,), 0)], disable_tqdm=True)
    return total


@pytest.fixture(scope="module", params=ARCHS)
def source(request, tmp_path_factory):
    """A tiny random checkpoint with a character-level tokenizer, the requests, and HFLM's scores of the source."""
    pytest.importorskip("lm_eval")
    folder = tmp_path_factory.mktemp(request.param) / "src"
    model = tm.make_tiny(request.param, folder)
    char_tokenizer(folder)
    pairs = PAIRS + [greedy_pair(folder)]
    lm = hflm(folder)
    results = score(lm, pairs)
    assert len(results) == len(pairs)
    assert results[-1][1], "the source's own greedy continuation must be greedy"
    return dict(arch=request.param, folder=folder, config=model.config, pairs=pairs, results=results,
                rolling=rolling(lm))


def convert(kind: str, src: dict, out: Path) -> None:
    given = resolve_source(str(src["folder"]))
    config = src["config"]
    if kind == "gqa-same":  # as many K/V heads as the source: exact
        convert_to_kv_heads(given, out, GQAOptions(kv_heads=tm.kv_heads_of(config)), progress=False)
    elif kind == "mqa":
        convert_to_kv_heads(given, out, MQAOptions(), progress=False)
    elif kind == "talking-heads":  # identity mixing at init: exact
        convert_to_talking_heads(given, out, TalkingHeadsOptions(), progress=False)
    elif kind == "switchhead":  # one expert per head: exact
        convert_to_switchhead(given, out, SwitchHeadOptions(heads=config.num_attention_heads, experts=1, topk=1),
                              progress=False)
    else:
        raise ValueError(kind)


@pytest.mark.parametrize("kind, model_class", [
    ("gqa-same", None),
    ("talking-heads", "TalkingHeads"),
    ("switchhead", "SwitchHead"),
])
def test_exact_conversion_scores_like_the_source(source, kind, model_class, tmp_path):
    convert(kind, source, tmp_path / kind)
    assert (tmp_path / kind / "tokenizer.json").exists()  # the tokenizer travels with the checkpoint
    lm = hflm(tmp_path / kind)
    if model_class:  # custom-code outputs run their own modeling code, not the plain architecture's
        assert type(lm.model).__name__.startswith(model_class)
    else:  # a standard checkpoint: transformers' own class, the source's K/V head count
        assert type(lm.model).__module__.startswith("transformers.models.")
        assert tm.kv_heads_of(lm.model.config) == tm.kv_heads_of(source["config"])
    results = score(lm, source["pairs"])
    assert len(results) == len(source["results"])
    diff = max(abs(a - b) for (a, _), (b, _) in zip(results, source["results"]))
    assert diff <= TOL, f"{kind}: max |Δ loglikelihood| {diff}"
    assert [g for _, g in results] == [g for _, g in source["results"]]
    assert results[-1][1]  # the source's greedy continuation is still greedy
    assert abs(rolling(lm) - source["rolling"]) <= TOL * len(ROLLING)  # a sum over len(ROLLING) tokens


def test_lossy_mqa_scores_finite_and_different(source, tmp_path):
    convert("mqa", source, tmp_path / "mqa")
    lm = hflm(tmp_path / "mqa")
    assert type(lm.model).__module__.startswith("transformers.models.")  # standard checkpoint (gpt2 -> gpt_bigcode)
    assert tm.kv_heads_of(lm.model.config) == 1
    results = score(lm, source["pairs"])
    assert all(math.isfinite(ll) and ll < 0 for ll, _ in results)
    diff = max(abs(a - b) for (a, _), (b, _) in zip(results, source["results"]))
    assert diff > 1e-2, f"MQA pooled the K/V heads into one yet scores like the source (max |Δ| {diff})"
    total = rolling(lm)
    assert math.isfinite(total) and total != source["rolling"]
