"""FSDP that is right at scale: every shipped accelerate config is FSDP2; under bf16 the policy computes in bf16 and
reduces gradients in fp32; buffers (RoPE's inv_freq) stay fp32 and the rotary tables exact after `prepare`; the
gradient norm of a partly trained model is the norm over every rank's shards."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import FullyShardedDataParallelPlugin

from surgery.errors import SurgeryError
from surgery.training.accelerator import use_fsdp2

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))
FSDP1_ONLY = {"fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states",
              "fsdp_forward_prefetch"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_accelerate_config_is_fsdp2(path):
    config = load_config_from_file(str(path))  # as `accelerate launch --config_file` reads it
    assert config.distributed_type == "FSDP"
    fsdp = config.fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert not FSDP1_ONLY & fsdp.keys(), FSDP1_ONLY & fsdp.keys()
    assert isinstance(fsdp["fsdp_reshard_after_forward"], bool)  # FSDP2's form (FSDP1's is a strategy name)
    assert config.mixed_precision in ("no", "bf16")


def test_the_gpu_config_is_bf16_and_shards_by_decoder_layer():
    config = load_config_from_file(str(REPO / "recipes/accelerate/fsdp-8gpu.yaml"))
    assert config.mixed_precision == "bf16" and not config.use_cpu
    assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


def fsdp_accelerator(version: int, mixed_precision: str):
    """What `use_fsdp2` reads of an Accelerator: its FSDP plugin, as accelerate built it, and its mixed precision."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)  # what accelerate's state does with `mixed_precision: bf16`
    return types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision=mixed_precision)


def test_fsdp2_under_bf16_computes_in_bf16_and_reduces_gradients_in_fp32():
    acc = fsdp_accelerator(2, "bf16")
    assert acc.state.fsdp_plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16  # accelerate's own choice
    use_fsdp2(acc)
    policy = acc.state.fsdp_plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    acc = fsdp_accelerator(2, "no")
    use_fsdp2(acc)
    assert acc.state.fsdp_plugin.mixed_precision_policy is None  # fp32 throughout


def test_fsdp1_is_refused_with_the_reason():
    with pytest.raises(SurgeryError, match="FSDP2 only .*FSDP1.*inv_freq.*fsdp_version: 2"):
        use_fsdp2(fsdp_accelerator(1, "bf16"))


def gpu_config_on_cpu(folder: Path) -> Path:
    """recipes/accelerate/fsdp-8gpu.yaml as it is (FSDP2, bf16, its sharding keys), on 2 CPU processes over gloo."""
    import yaml

    config = yaml.safe_load((REPO / "recipes/accelerate/fsdp-8gpu.yaml").read_text())
    path = folder / "fsdp-8gpu-on-cpu.yaml"
    path.write_text(yaml.safe_dump(config | {"use_cpu": True, "num_processes": 2}))
    return path


def test_fsdp2_bf16_keeps_rope_buffers_fp32_and_the_rotary_tables_exact(tiny, tokenizer, tmp_path):
    """The shipped GPU config on 2 CPU processes with bf16: after uptrain's own make_accelerator, loading, teacher
    sharding and `prepare` (surgery.testing.fsdp_probe), every rank's student and teacher keep inv_freq in fp32 and
    compute the same cos/sin at positions 0..4095 as the checkpoints loaded alone; the policy reduces in fp32. Rank 0
    alone read the weights, every rank holds the checkpoint's (gathered from the shards), the teacher in bf16."""
    import json
    import subprocess
    import sys

    from surgery.testing.pydoc_llama import make_model

    teacher = make_model(tmp_path / "teacher", tokenizer, seed=1)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(gpu_config_on_cpu(tmp_path)),
           "--main_process_port", "0", "-m", "surgery.testing.fsdp_probe", str(tmp_path), "bf16", str(tiny),
           str(teacher)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert got["distributed_type"] == "FSDP" and got["world"] == 2 and got["mixed_precision"] == "bf16"
        assert got["policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
        for role in ("student", "teacher"):
            buffers = got[role]["buffers"]
            assert {n for n in buffers if n.endswith("inv_freq")} == {"model.rotary_emb.inv_freq",
                                                                       "model.rotary_emb.original_inv_freq"}
            assert all(dtype == "float32" for dtype in buffers.values()), (rank, role, buffers)
            assert got[role]["rotary_exact"] == {"model.rotary_emb": True}, (rank, role)
            assert got[role]["weights_differ"] == [], (rank, role)  # the shards rank 0 read and sent
        assert got["teacher_param_dtypes"] == ["bfloat16"]  # frozen: loaded in the compute precision
        assert got["read_weights"] == {"model": rank == 0, "teacher": rank == 0}  # rank 1 receives its shards


@pytest.mark.slow  # two accelerate launches (~1 min); the default suite checks FSDP2 in the GPU run's CPU mode
def test_fsdp2_clips_a_partly_trained_model_by_the_norm_over_every_ranks_shards(tiny, tmp_path):
    """--train attention (some parameters train) under FSDP on 2 CPU processes: step 1's gradient norm is the one
    process's on the same data (the norm over both ranks' shards, not each shard's own: FSDP1's fallback), and with
    clipping on (max norm below it) the clipped update, hence the weights, are the one process's too."""
    from inprocess import FSDP_CPU, cli_args, launch_uptrain
    from surgery.testing.pydoc_llama import FAST, metrics, weights
    from surgery.training import UptrainOptions, uptrain

    args = dict(FAST, loss="lm", train="attention", tokens=FAST["batch_tokens"], eval_tokens=512, max_grad_norm=0.05)
    uptrain(UptrainOptions(model=str(tiny), out=tmp_path / "one", **args))
    result = launch_uptrain(FSDP_CPU + ["--main_process_port", "0"],
                            [tiny, "--out", tmp_path / "fsdp", *cli_args(args)], OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters sharded by FSDP" in result.stdout
    norm_one, norm_fsdp = ([m["grad_norm"] for m in metrics(tmp_path / out) if "grad_norm" in m] for out in ("one", "fsdp"))
    assert len(norm_one) == 1 and norm_one[0] > 2 * args["max_grad_norm"]  # clipping changes the update
    assert norm_fsdp == pytest.approx(norm_one, rel=1e-5)
    one, fsdp, before = weights(tmp_path / "one"), weights(tmp_path / "fsdp"), weights(tiny)
    for k in one:
        torch.testing.assert_close(fsdp[k], one[k], atol=1e-6, rtol=1e-5)
    assert not torch.equal(one["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(one["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])


def test_a_rank_that_receives_its_shards_builds_the_model_without_reading_a_weight(tiny, tmp_path):
    """load_causal_lm(weights=False) on a folder with no weight file at all: the student's shape, tied embeddings
    tied, distinct CPU parameters (the optimizer and FSDP2's preparation map them by storage), and RoPE's inv_freq
    (not in the checkpoint) in fp32, equal to the loaded model's."""
    import shutil

    import transformers as tf

    from surgery.checkpoint.source import resolve_source
    from surgery.training.model_io import load_causal_lm

    config = tf.AutoConfig.from_pretrained(tiny)
    config.tie_word_embeddings = True
    folder = tmp_path / "config-only"
    folder.mkdir()
    config.save_pretrained(folder)
    for f in tiny.glob("tokenizer*"):
        shutil.copy(f, folder)
    assert not list(folder.glob("*.safetensors"))
    built = load_causal_lm(resolve_source(str(folder)), "model", weights=False, dtype=torch.bfloat16)
    assert built.lm_head.weight is built.model.embed_tokens.weight
    params = list(built.parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params)
    assert len({p.data_ptr() for p in params}) == len(params)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert built.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(built.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)
    assert {n for n, _ in built.named_parameters()} == {n for n, _ in loaded.named_parameters()} - {"lm_head.weight"}
