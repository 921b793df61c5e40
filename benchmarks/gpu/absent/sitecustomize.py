"""On the PYTHONPATH of `benchmarks/gpu/run.sh --cpu` and the processes it launches: the packages named in
GPU_RUN_ABSENT (comma-separated) import as if not installed (sys.modules[name] = None: `import` raises
ModuleNotFoundError, importlib.util.find_spec answers None), as on the bare GPU machine, so a CPU run that passes
proves the GPU run needs none of them."""

import os
import sys

for _name in filter(None, os.environ.get("GPU_RUN_ABSENT", "").split(",")):
    sys.modules.setdefault(_name, None)
