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


def test_package_discovery_leaves_the_checkout_cli_module_out():
    """pyproject's package discovery (read as setuptools reads it, no build) finds the `surgery` package and all its
    subpackages, and nothing else: no top-level module such as the checkout's `cli.py` goes into site-packages."""
    import tomllib
    from pathlib import Path

    from setuptools import find_packages

    repo = Path(__file__).resolve().parents[1]
    assert (repo / "cli.py").is_file()  # the checkout's entry that must stay out
    tool = tomllib.loads((repo / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    assert "py-modules" not in tool  # no top-level modules listed explicitly
    # explicit package discovery: without it setuptools' automatic flat-layout discovery would pick up cli.py
    assert "find" in tool.get("packages", {}), "pyproject.toml lacks [tool.setuptools.packages.find]"
    find = tool["packages"]["find"]
    found = set(find_packages(where=str(repo), include=find.get("include", ["*"]), exclude=find.get("exclude", ())))
    on_disk = {".".join(p.parent.relative_to(repo).parts) for p in (repo / "surgery").rglob("__init__.py")}
    assert found == on_disk, (found ^ on_disk)
    assert all(name == "surgery" or name.startswith("surgery.") for name in found)
