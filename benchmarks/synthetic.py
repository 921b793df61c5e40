"""Synthetic checkpoints with the exact layouts of real models, random bf16 weights, written shard by shard.

    python benchmarks/synthetic.py llama3-8b [--layers K] [--out /work/scratch/scale]
    python benchmarks/synthetic.py qwen2.5-3b gemma2-2b

Each folder holds what the hub repository holds: config.json (the real model's fields: rope_theta, llama3
rope_scaling, biases, softcapping, sliding window, query_pre_attn_scalar ...), safetensors shards of at most
5 GB with model.safetensors.index.json, and a tokenizer. Tensor names, shapes and order come from the model
class itself, built on the meta device (nothing allocated), so they are exactly what transformers expects.
Weights are random (seeded per tensor name): linear and embedding matrices N(0, 0.02), norms at identity
(ones; zeros for Gemma's 1 + w norms), biases N(0, 0.02). They are generated one tensor at a time (in row
blocks for the embeddings) and written through the toolkit's own shard writer (surgery/checkpoint/tensors.py), so the
whole model is never in memory: peak RSS is about the largest tensor (the 8B's 1 GB embedding).

The tokenizer is SmolLM2's (49,152 tokens, from the embedded checkpoint); vocab_size stays the real model's,
so ids past the tokenizer's vocabulary simply never occur. `--layers K` keeps the per-layer shapes and writes
K decoder layers only (for timing a few layers of a model too slow to convert whole on a small machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import torch


from surgery.checkpoint.atomic import atomic_output_dir  # noqa: E402
from surgery.checkpoint.tensors import PlannedTensor, write_checkpoint  # noqa: E402

DEFAULT_OUT = Path("/work/scratch/scale")
MAX_SHARD = 5_000_000_000
STD = 0.02
ROW_BLOCK = 8192  # rows generated at a time for large matrices

# The real models' config.json fields (hub repositories meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-3B, google/gemma-2-2b).
LAYOUTS: dict[str, dict] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "head_dim": 128, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256,
    },
    "qwen2.5-3b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 32768,
        "max_window_layers": 36, "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "gemma2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1,
        "cache_implementation": "hybrid", "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
        "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
        "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 256000,
    },
}
ZERO_CENTRED_NORMS = {"gemma2"}  # norms compute x * (1 + w): identity at w = 0


def skeleton(config: dict) -> torch.nn.Module:
    """The model class of `config`, on the meta device (no memory): proves transformers builds the layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    cfg = AutoConfig.for_model(config["model_type"], **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def tensor_layout(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the checkpoint stores, in the model's state_dict order (tied head left out)."""
    model = skeleton(config)
    state = model.state_dict()
    tied = config.get("tie_word_embeddings", False)
    return [(name, tuple(t.shape)) for name, t in state.items() if not (tied and name == "lm_head.weight")]


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def random_tensor(name: str, shape: tuple[int, ...], model_type: str) -> torch.Tensor:
    """The tensor's synthetic value, in bf16, generated block by block (never a float32 copy of a large matrix)."""
    if name.endswith("norm.weight"):
        fill = 0.0 if model_type in ZERO_CENTRED_NORMS else 1.0
        return torch.full(shape, fill, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(_seed(name))
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = out.view(shape[0], -1) if len(shape) > 1 else out.view(1, -1)
    for start in range(0, rows.shape[0], ROW_BLOCK):
        block = rows[start:start + ROW_BLOCK]
        block.copy_(torch.randn(block.shape, generator=gen) * STD)
    return out


def write_synthetic(layout: str, out: Path, layers: int | None = None, force: bool = False) -> Path:
    """Write the synthetic checkpoint `layout` (optionally with only `layers` decoder layers) into `out`."""
    config = dict(LAYOUTS[layout])
    if layers is not None:
        config["num_hidden_layers"] = layers
        if "max_window_layers" in config:
            config["max_window_layers"] = layers
    tensors = tensor_layout(config)
    planned = [PlannedTensor(name, torch.bfloat16, shape,
                             produce=lambda n=name, s=shape: random_tensor(n, s, config["model_type"]))
               for name, shape in tensors]
    total = sum(t.nbytes for t in planned)
    done = [0, time.time()]

    def progress(nbytes: int) -> None:
        done[0] += nbytes
        if time.time() - done[1] > 10:
            done[1] = time.time()
            print(f"  {layout}: {done[0] / 1e9:.1f} / {total / 1e9:.1f} GB", flush=True)

    with atomic_output_dir(out, force=force) as tmp:
        files = write_checkpoint(tmp, planned, MAX_SHARD, progress=progress)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_tokenizer(tmp)
        (tmp / "SYNTHETIC.md").write_text(
            f"Synthetic {layout} layout: random bf16 weights (N(0, {STD}), norms at identity), SmolLM2 tokenizer, "
            f"vocab_size {config['vocab_size']}. Written by benchmarks/synthetic.py; not a trained model.\n")
    print(f"wrote {out}: {len(tensors)} tensors, {total / 1e9:.2f} GB in {len(files)} shard(s)")
    return out


def copy_tokenizer(folder: Path) -> None:
    from surgery.checkpoint.source import resolve_source

    src = resolve_source("smollm2").folder
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy2(src / name, folder / name)


def folder_for(layout: str, layers: int | None, root: Path) -> Path:
    return root / (f"{layout}-{layers}layers" if layers is not None else layout)


def ensure(layout: str, layers: int | None = None, root: Path = DEFAULT_OUT) -> Path:
    """The synthetic folder, written the first time only (write once, reuse)."""
    folder = folder_for(layout, layers, root)
    if not (folder / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        write_synthetic(layout, folder, layers)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("layouts", nargs="+", choices=sorted(LAYOUTS))
    p.add_argument("--layers", type=int, help="Decoder layers to write (default: the real model's).")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Parent folder.")
    p.add_argument("--force", action="store_true", help="Rewrite a folder that exists.")
    args = p.parse_args()
    torch.set_num_threads(1)
    for layout in args.layouts:
        folder = folder_for(layout, args.layers, args.out)
        if (folder / "config.json").exists() and not args.force:
            print(f"{folder} exists (use --force to rewrite)")
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        write_synthetic(layout, folder, args.layers, force=args.force)


if __name__ == "__main__":
    main()
