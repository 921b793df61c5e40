"""Publishing a converted checkpoint: validate the folder, write its model card, push it to the hub.

(The sha256 of a checkpoint's files are recorded and verified by surgery/checkpoint/record.py, the owner of surgery.json.)
- `validate.py` the checks `surgery push` runs before uploading anything.
- `card.py`     the README.md model card (YAML metadata + conversion, check, uptraining, how to load).
- `push.py`     create the repo / branch and upload the folder with huggingface_hub.
"""

from .validate import validate_folder

__all__ = ["validate_folder"]
