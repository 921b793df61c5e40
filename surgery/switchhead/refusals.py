"""What SwitchHead cannot convert (surgery.arch's family features), in its words. Torch-free: the kind
(surgery/switchhead/kind.py) and the converter both read it."""

from ..arch import ENCODERS_NEED_CODE, Feature

KIND = "switchhead"
_PER_HEAD_NORMS = "SwitchHead cannot regroup q/k norms that give each head its own weight ({detail})"
REFUSES = {
    Feature.ENCODER: ENCODERS_NEED_CODE,
    Feature.OWN_ATTENTION: "{detail}: SwitchHead cannot attend in its place",
    Feature.CLIP_QKV: "SwitchHead sums value experts and cannot clamp their sum as {detail}",
    Feature.WHOLE_QK_NORM: "{detail}; SwitchHead regroups heads one by one and cannot carry that norm",
    Feature.NORM_MODULE_PER_HEAD: _PER_HEAD_NORMS,
    Feature.PER_HEAD_QK_NORM: _PER_HEAD_NORMS,
}
