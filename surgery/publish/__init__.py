"""Publishing a converted checkpoint: validate the folder, write its model card, push it to the hub.

- `hashes.py`   sha256 of a checkpoint's output files, recorded in surgery.json by the converters
                (`record_output_hashes`) and checked before a push.
- `validate.py` the checks `surgery push` runs before uploading anything.
- `card.py`     the README.md model card (YAML metadata + conversion, check, uptraining, how to load).
- `push.py`     create the repo / branch and upload the folder with huggingface_hub.
"""

from .hashes import record_output_hashes
from .validate import validate_folder

__all__ = ["record_output_hashes", "validate_folder"]
