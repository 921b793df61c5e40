"""A hostile tiny checkpoint: its config's `auto_map` names `configuration_x.py` / `modeling_x.py`, which leave a
marker file when imported; and how the security tests look at what ran and what was written."""

from __future__ import annotations

import json
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
