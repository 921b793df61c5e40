"""What talking-heads cannot convert (surgery.arch's family features), in its words (encoders it converts: its
modeling code travels with the checkpoint, surgery.arch.ENCODERS_NEED_CODE). Torch-free: the kind
(surgery/talking_heads/kind.py) and the converter both read it."""

from ..arch import Feature

NAME = KIND = "talking-heads"
REFUSES = {Feature.OWN_ATTENTION: "{detail}: talking-heads cannot mix its heads"}
