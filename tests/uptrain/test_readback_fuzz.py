"""Property-based tests (issue 40) of what the toolkit reads back: a streamed run's data position and an MLA output's
config.json against its tensors. Every mutation ends in one of two ways: accepted and equal to what an honest value
gives, or one SurgeryError; never another exception or a hang (SIGALRM after HANG_SECONDS)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from inprocess import time_limit
from surgery.errors import SurgeryError
from surgery.mla.validate import check_mla
from surgery.training.stream_held_out import hold_out
from surgery.training.stream_readers import Reader, check_state
from surgery.training.stream_sources import Plan, resolve_sources

HANG_SECONDS = 20
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))



# ---- data positions --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan(tokenizer, tmp_path_factory):
    from surgery.data import pydoc_texts

    path = tmp_path_factory.mktemp("fuzz-data") / "d.jsonl"
    texts = pydoc_texts()
    path.write_text("".join(json.dumps({"text": texts[d][:300] if d % 5 else ""}) + "\n" for d in range(12)))
    sources = resolve_sources([str(path)], [1.0])
    args = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, seq_len=16, seed=0, readers=1, epochs=2)
    _, held = hold_out(args, sources, 0)
    return Plan(sources=tuple(sources), held=held, **args)


def windows(plan, state, count):
    it = iter(Reader(plan, 0, state))
    return [next(it)[0].tolist() for _ in range(count)]


def saved(plan, k):
    reader = Reader(plan, 0, None)
    it = iter(reader)
    for _ in range(k):
        next(it)
    return json.loads(json.dumps(reader.state()))


VALUES = st.one_of(st.integers(-2, 3), st.integers(0, 400), st.integers(-(2 ** 70), 2 ** 70), st.booleans(),
                   st.none(), st.text(max_size=3), st.floats(allow_nan=True), st.lists(st.integers(), max_size=2))
FIELDS = [("start", "epoch"), ("start", "doc"), ("start", "offset"), ("start", "skipped"), ("start", "tokens"),
          ("block",), ("emitted",), ("skipped",), ("tokens",)]


@settings(max_examples=50, **SETTINGS)
@given(k=st.integers(0, 20), field=st.sampled_from(FIELDS), value=VALUES)
@example(k=3, field=("start", "offset"), value=400)  # past its document: looped for ever
@example(k=0, field=("start", "offset"), value=2 ** 70)
def test_a_mutated_position_resumes_exactly_or_is_one_error(plan, k, field, value):
    honest = saved(plan, k)
    state = copy.deepcopy(honest)
    target = state["sources"][0]
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    with time_limit(HANG_SECONDS):
        try:
            check_state(state, plan)
            got = windows(plan, state, 3)
        except SurgeryError as e:  # refused as altered, or (a position moved later, still inside the data) dry
            assert "\n" not in str(e) and ("data position in the checkpoint is not valid" in str(e)
                                            or "ran dry" in str(e)), e
            return
    if field[-1] in ("skipped", "tokens") or value == _get(honest, field):  # counters only: the same windows
        assert got == windows(plan, None, k + 3)[k:]


def _get(state, field):
    target = state["sources"][0]
    for key in field:
        target = target[key]
    return target


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
@settings(max_examples=25, **SETTINGS)
@given(k=st.integers(0, 60))
def test_an_honest_position_resumes_to_the_same_windows(plan, k):
    assert windows(plan, saved(plan, k), 4) == windows(plan, None, k + 4)[k:]


# ---- MLA config.json against the tensors -----------------------------------------------------------------------
SIZES = st.fixed_dictionaries({"kv_lora_rank": st.integers(1, 64), "qk_rope_head_dim": st.integers(1, 32),
                               "qk_nope_head_dim": st.integers(1, 32), "v_head_dim": st.integers(1, 32),
                               "num_attention_heads": st.integers(1, 8), "hidden_size": st.integers(1, 96)})


def shapes_of(c: dict, layers: int = 2) -> dict:
    r, rope, nope, v, h, H = (c[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                             "num_attention_heads", "hidden_size"))
    one = {"kv_a_proj_with_mqa": (r + rope, H), "kv_b_proj": (h * (nope + v), r), "kv_a_layernorm": (r,),
           "q_proj": (h * (nope + rope), H), "o_proj": (H, h * v)}
    return {f"model.layers.{i}.self_attn.{n}.weight": s for i in range(layers) for n, s in one.items()}


@settings(max_examples=200, **SETTINGS)
@given(config=SIZES, key=st.sampled_from(["kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                          "num_attention_heads", "hidden_size"]),
       value=st.one_of(st.integers(-3, 100), st.integers(2 ** 20, 2 ** 64), st.text(max_size=3), st.booleans(),
                       st.floats(allow_nan=True), st.none()))
def test_an_edited_mla_config_passes_only_when_the_tensors_agree(config, key, value):
    shapes = shapes_of(config)
    check_mla(config, shapes)  # the honest config passes
    edited = config | {key: value}
    try:
        check_mla(edited, shapes)
    except SurgeryError as e:
        assert str(e).startswith(("config.json: ", "tensor ")) and "\n" not in str(e)
        return
    # accepted: the edit gives the same tensor shapes (e.g. rope and nope swapped in one sum), or changes nothing
    assert shapes_of(edited) == shapes
