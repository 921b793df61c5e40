"""What the MLA conversion cannot convert, and what it converts only approximately (surgery.arch's family
features), in its words. MLA rebuilds the source's layer as DeepSeek-V3's: a body that is not Llama's is refused in
the family's own words; what DeepSeek-V3's layer cannot hold but calibration can absorb (projection biases, per-head
q/k norms) is approximate, its error measured. Torch-free: the kind (surgery/kinds/mla.py) and the converter both
read it."""

from ..arch import Feature
from ..talking_heads.refusals import ENCODERS_NEED_CODE

KIND = "mla"
REFUSES = {Feature.BODY: "{detail}", Feature.ENCODER: ENCODERS_NEED_CODE,
           Feature.WHOLE_QK_NORM: "{detail} (DeepSeek-V3 has no q/k norms)",
           Feature.PER_HEAD_QK_NORM: "per-head q/k norms with per-head weights ({detail}; DeepSeek-V3 has none)",
           Feature.CLIP_QKV: "{detail} (DeepSeek-V3 clamps nothing)"}
APPROXIMATES = {
    Feature.QKV_BIAS: "{detail} absorbed by the query and output refits (DeepSeek-V3 and vLLM's MLA have no "
                      "projection biases)",
    Feature.SHARED_QK_NORM: "{detail} linearised at their calibration RMS and absorbed by the query and output "
                            "refits (DeepSeek-V3 has no per-head q/k norms)",
}
