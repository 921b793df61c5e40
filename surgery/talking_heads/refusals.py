"""What talking-heads cannot convert (surgery.arch's family features), in its words; and what the kinds that cannot
convert encoders say instead (talking-heads can: its modeling code travels with the checkpoint). Torch-free: the
kind (surgery/talking_heads/kind.py) and the converter both read it."""

from ..arch import Feature

NAME = KIND = "talking-heads"
ENCODERS_NEED_CODE = f"encoders need modeling code that travels with the checkpoint: use --to {NAME}"
REFUSES = {Feature.OWN_ATTENTION: "{detail}: talking-heads cannot mix its heads"}
