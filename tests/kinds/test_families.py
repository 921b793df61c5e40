"""The family registry: one data entry is all a Llama-like family needs for every kind; families a kind cannot
convert exactly say why in one line; `surgery convert --list` and the docs' table (docs/tasks/convert.md) are
the same table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from surgery.testing import tiny_models as tm
import torch
import transformers as tf
from surgery.testing.tiny_models import char_tokenizer

from surgery import arch
from surgery.arch import ArchSpec, register, unregister
from surgery.kinds import spec_for, support_labels, support_markdown
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import GQAOptions, MQAOptions
from surgery.errors import SurgeryError
from surgery.kv.aligned import convert_aligned
from surgery.checkpoint.source import resolve_source
from surgery.switchhead import convert_to_switchhead
from surgery.switchhead.options import SwitchHeadOptions
from surgery.talking_heads import convert_to_talking_heads
from surgery.talking_heads.options import TalkingHeadsOptions

REPO = Path(__file__).resolve().parents[2]
NEW_TYPE = "seed_oss"  # a Llama-like family transformers has and the registry does not


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.fixture
def seed_oss(tmp_path):
    """A tiny random SeedOss checkpoint (GQA, q/k/v/o biases) with a tokenizer, and no registry entry for it."""
    assert arch.find_spec(NEW_TYPE) is None
    torch.manual_seed(0)
    config = tf.SeedOssConfig(**tm.COMMON, **tm.TOKENS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              attention_bias=True, attention_out_bias=True)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    folder = tmp_path / "src"
    model.save_pretrained(folder)
    char_tokenizer(folder)
    yield folder, model
    unregister(NEW_TYPE)


def max_diff(a, b) -> float:
    ids = tm.sample_ids()
    return (tm.logits(a, ids) - tm.logits(b, ids)).abs().max().item()


def test_one_entry_registers_a_family_for_every_kind(seed_oss, tmp_path):
    folder, source = seed_oss
    src = resolve_source(str(folder))
    with pytest.raises(SurgeryError, match="unsupported architecture 'seed_oss'"):
        convert_to_kv_heads(src, tmp_path / "refused", MQAOptions(), progress=False)

    register(ArchSpec(NEW_TYPE))  # the whole of it

    assert f"| {NEW_TYPE} |" in support_markdown()
    # MQA/GQA, mean: exact at G = source K/V heads; G = 1 pools each K head with the mean of the source's
    convert_to_kv_heads(src, tmp_path / "same", GQAOptions(kv_heads=2), progress=False)
    assert max_diff(source, tm.load(tmp_path / "same")) <= 1e-5
    convert_to_kv_heads(src, tmp_path / "mqa", MQAOptions(), progress=False)
    k_src, k_out = source.model.layers[1].self_attn.k_proj, tm.load(tmp_path / "mqa").model.layers[1].self_attn.k_proj
    torch.testing.assert_close(k_out.weight, k_src.weight.view(2, 16, -1).mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(k_out.bias, k_src.bias.view(2, 16).mean(0), rtol=0, atol=1e-6)
    # aligned merge: exact at G = source K/V heads, and it runs the calibrated merge at G = 1
    convert_aligned(src, tmp_path / "aligned-same", GQAOptions(kv_heads=2, merge="aligned", calib=["pydoc"], calib_tokens=512),
                    progress=False)
    assert max_diff(source, tm.load(tmp_path / "aligned-same")) <= 1e-5
    record = convert_aligned(src, tmp_path / "aligned", MQAOptions(merge="aligned", calib=["pydoc"], calib_tokens=512),
                             progress=False)
    assert record["kv_heads"] == {"before": 2, "after": 1} and record["calibration"]["tokens"] == 512
    # talking-heads: identity mixing is exact, with classes made for the new family
    convert_to_talking_heads(src, tmp_path / "th", TalkingHeadsOptions(), progress=False)
    th = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "th", trust_remote_code=True, dtype=torch.float32).eval()
    assert type(th).__name__ == "TalkingHeadsSeedOssForCausalLM" and th.config.model_type == "talking_heads_seed_oss"
    assert max_diff(source, th) <= 1e-5
    # SwitchHead with one expert per head is exact
    convert_to_switchhead(src, tmp_path / "sh", SwitchHeadOptions(heads=4, experts=1, topk=1), progress=False)
    sh = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "sh", trust_remote_code=True, dtype=torch.float32).eval()
    assert type(sh).__name__ == "SwitchHeadSeedOssForCausalLM"
    assert max_diff(source, sh) <= 1e-4


@pytest.mark.parametrize("family,args,message", [
    ("olmo2", ["--to", "switchhead", "--heads", "4", "--experts", "1", "--topk", "1"],
     "cannot convert 'olmo2': q/k norms over the whole projection couple all heads"),
    ("olmoe", ["--to", "mqa", "--merge", "aligned"], "cannot convert 'olmoe': q/k norms over the whole projection"),
    ("falcon", ["--to", "talking-heads"], "cannot convert 'falcon': FalconAttention computes attention itself"),
])
def test_refused_families_say_why_in_one_line(family, args, message, tmp_path):
    tm.make_tiny(family, tmp_path / "src")
    run = cli("convert", str(tmp_path / "src"), "--out", str(tmp_path / "out"), *args)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("surgery: error: ") and run.stderr.strip().count("\n") == 0
    assert message in run.stderr
    assert not (tmp_path / "out").exists()


def test_per_head_norms_refused_only_when_switched_on(tmp_path):
    config = tm.ARCHS["stablelm"]()
    config.qk_layernorm = True
    with pytest.raises(SurgeryError, match="cannot convert 'stablelm': MQA/GQA cannot regroup q/k norms"):
        spec_for(config.to_dict(), "mqa/gqa mean")
    assert spec_for(tm.ARCHS["stablelm"]().to_dict(), "mqa/gqa mean").name == "stablelm"
    # Cohere's use_qk_norm: mean pooling pools the per-head K norm weights consecutively; the aligned merge groups
    # heads by similarity and reorders the query heads, which the per-head q/k norm weights cannot follow
    assert spec_for(tm.ARCHS["cohere_qk"]().to_dict(), "mqa/gqa mean").name == "cohere"
    with pytest.raises(SurgeryError, match="cannot convert 'cohere': the aligned merge cannot regroup q/k norms"):
        spec_for(tm.ARCHS["cohere_qk"]().to_dict(), "mqa/gqa aligned")
    assert spec_for(tm.ARCHS["cohere"]().to_dict(), "mqa/gqa aligned").name == "cohere"


def test_list_prints_the_table_and_readme_has_the_same():
    run = cli("convert", "--list")
    assert run.returncode == 0, run.stderr
    assert run.stdout == support_markdown()
    page = (REPO / "docs" / "tasks" / "convert.md").read_text()
    block = re.search(r"<!-- families:begin -->\n(.*?)<!-- families:end -->", page, re.DOTALL)
    assert block and block.group(1) == run.stdout, \
        "docs/tasks/convert.md's table is stale: paste `surgery convert --list` into it"
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| model_type")]
    columns = run.stdout.splitlines()[0].strip("| ").split(" | ")
    counts = {kind: sum(row.strip("| ").split(" | ")[columns.index(kind)] == "yes" for row in rows)
              for kind in support_labels()}
    assert counts["mqa/gqa mean"] >= 20 and counts["mqa/gqa aligned"] >= 20
    assert counts["talking-heads"] >= 14 and counts["switchhead"] >= 14
    # every family the table calls supported has a tiny model the parametrized exactness tests run on
    tested = {tm.ARCHS[a]().model_type for a in tm.ARCHS} | {"bert"}
    assert {row.strip("| ").split(" | ")[0] for row in rows} <= tested


def test_families_state_facts_and_each_kind_words_its_own_refusals():
    """surgery/arch.py names no kind: a kind registered at test time that refuses one family feature gets its
    `--list` column and its one-line refusal, worded by the kind around the family's own words for the feature."""
    from surgery.arch import Feature
    from surgery.kinds import Kind, WriteOptions, register, unregister

    source = (REPO / "surgery" / "arch.py").read_text()
    assert not [label for label in support_labels() if f'"{label}"' in source]
    register(Kind("clipless", WriteOptions, refuses={Feature.CLIP_QKV: "clipless cannot clamp as {detail}"}))
    try:
        olmo = tm.ARCHS["olmo"]().to_dict()
        with pytest.raises(SurgeryError, match=r"^clipless cannot convert 'olmo': clipless cannot clamp as OLMo's "
                                               r"clip_qkv clamps v_proj; supported: "):
            spec_for({**olmo, "clip_qkv": 8.0}, "clipless")
        assert spec_for(olmo, "clipless").name == "olmo"  # the feature is off without the key
        table = support_markdown()
        assert " clipless |" in table.splitlines()[0]
        assert "- olmo: clipless refused when `clip_qkv` is set (clipless cannot clamp as OLMo's" in table
    finally:
        unregister("clipless")
    with pytest.raises(SurgeryError, match="no conversion kind answers to 'clipless'"):
        spec_for(olmo, "clipless")
