"""`surgery check`'s options are one model (checking/options.py), built once, by the command line or the Python API,
and every rule on them holds before any checkpoint is resolved: a misspelled retrieval task, a bad length or count
is the option's own line, never a failure to find (or download) the checkpoints it was about."""

from __future__ import annotations

import pytest

import surgery
from surgery.checking.options import CheckOptions

NOWHERE = ("nobody/does-not-exist", "nobody/does-not-exist-either")  # hub ids that resolve to nothing

REFUSALS = [  # (options, the line that refuses them)
    ({"retrieval": "pasky"}, "unknown retrieval task 'pasky'; choose from passkey, niah_single"),
    ({"retrieval": "passkey", "retrieval_lengths": "32"},
     "--retrieval-lengths: 32 tokens is too short for a retrieval example (64 at least)"),
    ({"retrieval": "passkey", "retrieval_lengths": "512,3x"}, "--retrieval-lengths takes comma-separated token counts"),
    ({"retrieval": "passkey", "retrieval_samples": 0}, "--retrieval-samples must be at least 1, got 0"),
    ({"retrieval": "passkey", "retrieval_batch": 0}, "--retrieval-batch must be at least 1, got 0"),
    ({"retrieval_haystack": "text"}, "--retrieval-metric need --retrieval TASKS"),
    ({"retrieval_lengths": "512"}, "--retrieval-metric need --retrieval TASKS"),
    ({"retrieval_metric": "string"}, "--retrieval-metric need --retrieval TASKS"),
    ({"plot": "acc.png"}, "--plot draws the retrieval accuracy: it needs --retrieval TASKS"),
    ({"tokens": 0}, "--tokens must be at least 1 (got 0)"),
    ({"seq_len": -5}, "--seq-len must be at least 1 (got -5)"),
    ({"batch_size": 0}, "--batch-size must be at least 1 (got 0)"),
    ({"generate": -1}, "--generate must be 0 (off) or a number of tokens (got -1)"),
    ({"generate": 4, "prompt_len": 0}, "--prompt-len must be at least 1 (got 0)"),
    ({"prompts": "prompts.txt"}, "--prompts needs --generate N"),
    ({"tasks_limit": 2}, "--tasks-limit needs --tasks"),
    ({"tasks": "hellaswag", "tasks_limit": 0}, "--tasks-limit must be at least 1 (got 0)"),
    ({"precision": "bf16", "dtype": "float16"}, "--precision"),
]


def flags(options: dict) -> list[str]:
    args = []
    for name, value in options.items():
        for v in value if isinstance(value, list) else [value]:
            args += [f"--{name.replace('_', '-')}", str(v)]
    return args


@pytest.fixture
def resolved(monkeypatch):
    """Every checkpoint resolution, recorded (and done as usual)."""
    import surgery.checkpoint.source as source

    calls, real = [], source.resolve_source
    monkeypatch.setattr(source, "resolve_source", lambda spec, **kw: calls.append(spec) or real(spec, **kw))
    return calls


@pytest.mark.parametrize("options, message", REFUSALS, ids=lambda v: str(v)[:40])
def test_every_option_is_refused_before_any_checkpoint_is_resolved(options, message, resolved, cli):
    with pytest.raises(surgery.SurgeryError) as e:
        surgery.check(*NOWHERE, **options)
    assert message in str(e.value) and "\n" not in str(e.value)
    code, out, err = cli("check", *NOWHERE, *flags(options))
    assert code == 2 and err.strip() == f"surgery: error: {e.value}" and out == ""
    assert resolved == []


def test_without_a_bad_option_the_source_is_what_fails(resolved, cli):
    """The control: the same sources with good options get as far as resolving, where they fail."""
    with pytest.raises(surgery.SurgeryError, match="nobody/does-not-exist"):
        surgery.check(*NOWHERE, retrieval="passkey,", tokens=64)
    assert resolved == [NOWHERE[0]]


def test_the_api_takes_the_options_model_the_command_line_builds(resolved):
    options = CheckOptions(retrieval="passkey", retrieval_lengths="512,2w", tokens=64)
    assert options.model_fields_set == {"retrieval", "retrieval_lengths", "tokens"}
    with pytest.raises(surgery.SurgeryError, match="nobody/does-not-exist"):
        surgery.check(*NOWHERE, options)
    with pytest.raises(surgery.SurgeryError, match="^check: give the options as a CheckOptions or as keywords, "
                                                   "not both"):
        surgery.check(*NOWHERE, options, tokens=128)
    with pytest.raises(surgery.SurgeryError, match="^check: options is a CheckOptions, not dict$"):
        surgery.check(*NOWHERE, {"tokens": 64})
    assert resolved == [NOWHERE[0]]
