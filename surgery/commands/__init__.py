"""What each command does once its options are validated: the layer that both the command line (surgery/cli.py)
and YAML recipes (surgery/recipes) call. Layering, top to bottom: cli, recipes, commands, kinds (and the library).

- `convert.py`  `surgery convert`: options from the registry of kinds (surgery/kinds), the conversion, the dry run.
- `check.py`    `surgery check`: options model and the comparison.
- `uptrain.py`  `surgery uptrain`: options model and the training run.
- `push.py`     `surgery push`: options model and the upload.
- `compare_merges.py` `surgery compare-merges`: every K/V merge method side by side.
"""
