"""A hostile tiny checkpoint: its config's `auto_map` names `configuration_x.py` / `modeling_x.py`, which leave a
marker file when imported; how the security tests look at what ran and what was written; and a hostile disk (a
tiny tmpfs, empty or full)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from surgery.errors import SurgeryError
from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

CONFIGURATION_X = '''import pathlib
pathlib.Path({marker!r}).joinpath("configuration_x").write_text("imported")
from transformers import LlamaConfig


class XConfig(LlamaConfig):
    pass
'''
MODELING_X = '''import pathlib
pathlib.Path({marker!r}).joinpath("modeling_x").write_text("imported")
from transformers import LlamaForCausalLM

from .configuration_x import XConfig


class XForCausalLM(LlamaForCausalLM):
    config_class = XConfig
'''


def hostile_checkpoint(folder: Path, markers: Path) -> Path:
    """A tiny llama with a character tokenizer whose auto_map names code that leaves a file in `markers`."""
    markers.mkdir(parents=True, exist_ok=True)
    tm.make_tiny("llama", folder)
    char_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_x.py").write_text(CONFIGURATION_X.format(marker=str(markers)))
    (folder / "modeling_x.py").write_text(MODELING_X.format(marker=str(markers)))
    return folder


def cli_error(*args) -> str:
    """The one-line error of a command run in this process (the subprocess tests show it is printed as one line)."""
    import cli

    with pytest.raises(SurgeryError) as e:
        cli.cli.main([str(a) for a in args], prog_name="surgery", standalone_mode=False)
    return str(e.value)


def ran(markers: Path) -> list[str]:
    return sorted(p.name for p in markers.iterdir()) if markers.exists() else []


def listing(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def small_tmpfs(mount: Path, full: bool = False):
    """A 64 KiB tmpfs mounted at `mount` (where this user may mount one; the test is skipped elsewhere), smaller than
    the tiny model; with `full`, filled to the last byte by `.filler`. Unmounted on the way out."""
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        if full:
            with contextlib.suppress(OSError), open(mount / ".filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
