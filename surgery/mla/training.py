"""A well-conditioned form of the converted MLA layers for training, exactly equivalent to the stored one.

The conversion keeps `kv_a_layernorm` (an RMSNorm whose epsilon the format fixes at 1e-6) in its linear regime by
writing the latent rows of `kv_a_proj_with_mqa` about 1e-5 times smaller than the rope-key rows (surgery/mla/
factor.py). That is exact for inference but ill-conditioned for training: the gradients of those rows are ~1e5
times larger than the others' (a global gradient-norm clip then starves every other parameter), and Adam's steps,
about the learning rate in size, are ~30 times the rows' own magnitude — the first KD steps on SmolLM2 took the
loss from 0.49 to 22 and the gradient norm to 1e11.

For any s > 0, RMSNorm_eps(c) = RMSNorm_{eps/s^2}(c / s): dividing the latent rows (and their bias) by s and the
norm's epsilon by s^2 computes the same function, whatever the weights become. `LatentScale` trains in that form,
with s chosen so the latent rows have the rope rows' scale, and maps the weights back when they are saved; the
saved checkpoint is the stored format again (epsilon 1e-6), computing what the trained model computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_RESCALE = 0.1  # latent rows within 10x of the rope rows' scale are trained as they are


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean().sqrt())


@dataclass
class LatentScale:
    """The per-layer s of the training form, by the module name of each MLA attention."""

    scales: dict[str, float] = field(default_factory=dict)

    @classmethod
    def apply(cls, model: torch.nn.Module) -> LatentScale | None:
        """Put every MLA attention of `model` into the training form (in place); None when none needs it."""
        found = cls()
        for name, module in model.named_modules():
            a, norm = getattr(module, "kv_a_proj_with_mqa", None), getattr(module, "kv_a_layernorm", None)
            rank = getattr(module, "kv_lora_rank", None)
            if a is None or norm is None or not rank or a.weight.shape[0] <= rank:
                continue
            latent, rope = _rms(a.weight[:rank]), _rms(a.weight[rank:])
            if latent == 0 or rope == 0 or latent / rope >= MIN_RESCALE:
                continue
            s = latent / rope
            with torch.no_grad():
                a.weight[:rank] /= s
                if a.bias is not None:
                    a.bias[:rank] /= s
            norm.variance_epsilon = norm.variance_epsilon / s**2
            found.scales[name] = s
        return found if found.scales else None

    def restore(self, model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> None:
        """Back to the stored form before saving: the model in place, or (sharded training) the gathered state dict
        `state` whose keys are the model's parameter names."""
        modules = dict(model.named_modules())
        for name, s in self.scales.items():
            module = modules[name]
            rank = module.kv_lora_rank
            if state is None:  # (the saved config keeps rms_norm_eps: a gathered state leaves the model as it is)
                module.kv_a_layernorm.variance_epsilon *= s**2
            prefix = f"{name}.kv_a_proj_with_mqa."
            for suffix in ("weight", "bias"):
                if state is not None and prefix + suffix in state:
                    state[prefix + suffix] = state[prefix + suffix].clone()
                    state[prefix + suffix][:rank] *= s
                elif state is None and getattr(module.kv_a_proj_with_mqa, suffix, None) is not None:
                    with torch.no_grad():
                        getattr(module.kv_a_proj_with_mqa, suffix)[:rank] *= s
