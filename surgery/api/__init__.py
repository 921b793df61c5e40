"""The Python API: `surgery.convert`, `surgery.check`, `surgery.inspect`, `surgery.uptrain`, `surgery.push` and
`surgery.run_recipe`, `surgery.teacher`, `surgery.export`, `surgery.snapshot`, the commands of the same name as
functions that take the same options (by field name) and return results; `surgery.model_card`, the card `push` would upload, without uploading.

- `functions.py` the six functions; each validates its keywords with its command's options model
  (surgery.options.validate_options) and calls the library function the command line and the recipes call.
- `lineage.py`   where a loaded model came from (a hub id and its commit, a folder's name, or memory), for the record.
- `sources.py`   what a notebook has (a loaded model, a `datasets.Dataset`, a list of documents) written into the
  cache as a checkpoint folder or a .jsonl file, named by its sha256.
- `results.py`   what the functions return: ConversionResult, CheckReport, InspectReport, UptrainResult, PushResult,
  RecipeResult; Estimate and RecipePlan for a dry run.
"""

from ..errors import SurgeryError
from .functions import (Source, Text, check, convert, export, inspect, model_card, push, run_recipe, snapshot, teacher,
                        uptrain)
from .results import (CheckReport, ConversionResult, Estimate, InspectReport, PushResult, RecipePlan, RecipeResult,
                      TeacherStore, UptrainResult)

__all__ = ["CheckReport", "ConversionResult", "Estimate", "InspectReport", "PushResult", "RecipePlan", "RecipeResult",
           "Source", "SurgeryError", "TeacherStore", "Text", "UptrainResult", "check", "convert", "export", "inspect",
           "model_card", "push", "run_recipe", "snapshot", "teacher", "uptrain"]
