"""What each command does once its options are validated: the layer that the Python API (surgery/api; the command
line, surgery/cli.py, goes through it) and YAML recipes (surgery/recipes) call, each with the command's options
model. Layering, top to bottom: cli, api, recipes, commands, kinds (and the library); tests/test_registry.py's LAYERS
holds it.

- `convert.py`  `surgery convert`: options from the registry of kinds (surgery/kinds), the conversion, the dry run.
- `check.py`    `surgery check`: the comparison (its options model is surgery/checking/options.py) and its report.
- `uptrain.py`  `surgery uptrain`: options model and the training run.
- `snapshot.py` `surgery snapshot`: a step of an uptraining run folder as a model folder.
- `teacher.py`  `surgery teacher`: a teacher's stored log-probs for a run's windows.
- `push.py`     `surgery push`: options model and the upload.
- `export.py`   `surgery export`: a checkpoint as a GGUF file.
- `compare_merges.py` `surgery compare-merges`: every K/V merge method side by side.
"""
