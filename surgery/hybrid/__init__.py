"""`surgery convert SRC --to hybrid`: some layers keep their attention, the others become Mamba-2 state-space mixers
initialised from the attention they replace, written as a standard hybrid checkpoint that transformers loads with
no custom code.

The target type is `bamba` (BambaForCausalLM), chosen among transformers' hybrid attention/Mamba-2 types for being
the one that holds a Llama body exactly:
- bamba: Llama's layer (RMSNorm, gated SiLU MLP gate/up/down, q/k/v/o without biases, scaling 1/sqrt(head size),
  GQA, tied embeddings) plus Mamba-2 mixers; RoPE on every attention layer, full when `rope_parameters` says
  `partial_rotary_factor: 1.0` (its config defaults that to 0.5 for its own checkpoints; we write 1.0, and
  `attn_rotary_emb` = head size for the runtimes that read that); no multipliers. llama.cpp's converter takes
  BambaForCausalLM as its granite-hybrid architecture *with* RoPE.
- granitemoehybrid: dense with `num_local_experts: 0` and identity multipliers, RoPE with
  `position_embedding_type: rope`; but llama.cpp's converter turns RoPE off for every hybrid of that architecture
  (`use_rope` only for Bamba or attention-only models), so llama.cpp would compute another function.
- nemotron_h: a squared-ReLU MLP without a gate and attention without RoPE: not a Llama body.
- falcon_h1: attention and Mamba-2 in parallel in every layer, with a dozen multipliers: not a per-layer choice.

Modules:
- `family.py`    what converts (refusals from config.json alone), the Bamba config, the tensor names;
- `layers.py`    `--attention-layers`: a count, a list or `auto[:N]`;
- `init.py`      a mixer from its attention (Q->C, K->B, V->x, O->out_proj; the choices in its docstring);
- `calibrate.py` one streamed pass over calibration text: the mixers' statistics and `auto`'s scores;
- `convert.py`   the streamed write; `kind.py` the registry's entry (options, rules, cost model).
"""

from .convert import convert_to_hybrid

__all__ = ["convert_to_hybrid"]
