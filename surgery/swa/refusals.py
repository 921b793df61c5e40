"""What `--to swa` cannot convert (surgery.arch's family features), in its words. Torch-free: the kind
(surgery/swa/kind.py) and the converter both read it."""

from ..arch import ENCODERS_NEED_CODE, Feature

KIND = "swa"
REFUSES = {
    Feature.ENCODER: ENCODERS_NEED_CODE,
    Feature.NO_LAYER_TYPES: "{detail}",
    Feature.POSITIONS_BY_LAYER_TYPE: "{detail}: retyping a layer would change what it computes",
}
