"""The installed distribution: one top-level package (no module named `cli` in site-packages) and a `surgery`
command that runs the package's command line."""

from __future__ import annotations

import shutil
import subprocess
from importlib.metadata import distribution, entry_points


def test_installs_only_the_surgery_package_and_its_command():
    dist = distribution("attention-surgery")
    assert dist.read_text("top_level.txt").split() == ["surgery"]
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "surgery"]
    assert script.value == "surgery.cli:main"
    exe = shutil.which("surgery")
    assert exe, "pip install put no `surgery` command on PATH"
    run = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "convert" in run.stdout and "check" in run.stdout, run.stderr
