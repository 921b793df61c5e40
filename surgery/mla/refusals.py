"""What the MLA conversion cannot convert (surgery.arch's family features), in its words. MLA rebuilds the source's
layer as DeepSeek-V3's: a body that is not Llama's is refused in the family's own words, except the families of
surgery/mla/families.py (exact, or approximate with their biases/norms absorbed). Torch-free: the kind
(surgery/mla/kind.py) and the converter both read it."""

from ..arch import ENCODERS_NEED_CODE, Feature
from .families import body_refusal

KIND = "mla"
REFUSES = {Feature.BODY: body_refusal, Feature.ENCODER: ENCODERS_NEED_CODE,
           Feature.CLIP_QKV: "{detail}, which DeepSeek-V3's projections cannot"}
