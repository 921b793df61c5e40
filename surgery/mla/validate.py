"""An MLA checkpoint read back (`inspect`, `check`, `bench`, `uptrain`): config.json's latent sizes are positive
integers and every attention tensor has the shape they give, so that a config edited after the conversion (a wrong
`kv_lora_rank`) is refused in one line instead of being reported as a wrong KV cache or failing inside transformers."""

from __future__ import annotations

import re

from ..checkpoint.validate import HIDDEN_KEYS, MAX_COUNT, check_axis
from ..errors import SurgeryError

SIZES = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_TENSOR = re.compile(r"\.self_attn\.(kv_a_proj_with_mqa|kv_b_proj|kv_a_layernorm|q_proj|q_a_proj|q_b_proj|o_proj)"
                     r"\.weight$")


def size(config: dict, key: str, required: bool = True) -> int | None:
    """config.json's `key` as a positive integer of plausible size, else one line naming it."""
    value = config.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SurgeryError(f"config.json: {key} must be a positive integer, got {value!r}")
    if value > MAX_COUNT:
        raise SurgeryError(f"config.json: {key} = {value} is implausibly large (more than {MAX_COUNT})")
    return value


def check_mla(config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """config.json's MLA sizes, and the attention tensors (`shapes`: name -> shape, from the safetensors headers)
    against them."""
    r, rope, nope, v = (size(config, k) for k in SIZES)
    q_rank = size(config, "q_lora_rank", required=False)
    heads = size(config, "num_attention_heads")
    hidden = next((size(config, k) for k in HIDDEN_KEYS if k in config), None)
    expected = {  # projection -> (rows, what), (columns, what)
        "kv_a_proj_with_mqa": ((r + rope, f"kv_lora_rank {r} + qk_rope_head_dim {rope}"), (hidden, "hidden size")),
        "kv_b_proj": ((heads * (nope + v), f"{heads} heads x (qk_nope_head_dim {nope} + v_head_dim {v})"),
                      (r, f"kv_lora_rank {r}")),
        "kv_a_layernorm": ((r, f"kv_lora_rank {r}"), None),
        "q_proj": ((heads * (nope + rope), f"{heads} heads x (qk_nope_head_dim {nope} + qk_rope_head_dim {rope})"),
                   (hidden, "hidden size")),
        "q_a_proj": ((q_rank, f"q_lora_rank {q_rank}"), (hidden, "hidden size")),
        "q_b_proj": ((heads * (nope + rope), f"{heads} heads x (qk_nope_head_dim {nope} + qk_rope_head_dim {rope})"),
                     (q_rank, f"q_lora_rank {q_rank}")),
        "o_proj": ((hidden, "hidden size"), (heads * v, f"{heads} heads x v_head_dim {v}")),
    }
    for name, shape in shapes.items():
        hit = _TENSOR.search(name)
        if hit is None:
            continue
        rows, cols = expected[hit.group(1)]
        if len(shape) != (2 if cols else 1):
            raise SurgeryError(f"tensor {name} of shape {list(shape)} does not match config.json: expected "
                               f"{'a matrix' if cols else 'a vector'}")
        for axis, rule in enumerate((rows, cols)):
            if rule is not None and rule[0] is not None:
                check_axis(name, shape, axis, rule[0], rule[1])
