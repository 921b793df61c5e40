"""What the K/V-head merges cannot convert (surgery.arch's family features), in their words, per `convert --list`
column: the plain merges (mean, first, random; streamed tensor by tensor) and the aligned merge (computes each
layer's attention on calibration text). Torch-free: the kind (surgery/kv/kind.py) and the converters read it."""

from ..arch import ENCODERS_NEED_CODE, Feature

PLAIN_LABEL, ALIGNED_LABEL = "mqa/gqa mean", "mqa/gqa aligned"
_NORM_MODULES = "MQA/GQA cannot regroup q/k norms that give each head its own weight ({detail})"
PLAIN_REFUSES = {
    Feature.ENCODER: ENCODERS_NEED_CODE,
    Feature.TARGET_LACKS: "{detail}",
    Feature.NORM_MODULE_PER_HEAD: _NORM_MODULES,
}
ALIGNED_REFUSES = PLAIN_REFUSES | {
    Feature.OWN_ATTENTION: "{detail}: the aligned merge cannot record its queries and keys",
    Feature.WHOLE_QK_NORM: "{detail}; the aligned merge regroups heads one by one and cannot carry that norm",
    Feature.PER_HEAD_QK_NORM: "the aligned merge cannot regroup q/k norms that give each head its own weight "
                              "({detail})",
}
