"""What `surgery push` checks before uploading a folder: a loadable, complete, unmodified checkpoint."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SurgeryError
from ..checkpoint.tensors import read_safetensors_header
from ..trust import has_custom_code
from ..checkpoint.record import RECORD_FILE as RECORD, check_record, verify_record

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass
class Validation:
    folder: Path
    config: dict
    record: dict | None  # surgery.json, when the folder has one
    weight_files: list[str] = field(default_factory=list)
    code_files: list[str] = field(default_factory=list)  # the .py files auto_map needs

    @property
    def custom_code(self) -> bool:
        return has_custom_code(self.folder)


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SurgeryError(f"{what} {path} cannot be read: {str(e).splitlines()[0]}") from None
    if not isinstance(value, dict):
        raise SurgeryError(f"{what} {path} is not a JSON object")
    return value


def check_weights(folder: Path) -> list[str]:
    """The weight files, after checking that every shard the index names exists and holds its tensors."""
    index_path = next((folder / n for n in INDEX_FILES if (folder / n).exists()), None)
    if index_path is None:
        single = [n for n in ("model.safetensors", "pytorch_model.bin") if (folder / n).is_file()]
        if not single:
            raise SurgeryError(f"{folder} has no weights (no model.safetensors, pytorch_model.bin or shard index)")
        if single[0].endswith(".safetensors"):
            _header(folder / single[0])
        return single
    index = _read_json(index_path, "shard index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SurgeryError(f"shard index {index_path.name} has no weight_map")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise SurgeryError(f"shard(s) listed in {index_path.name} missing from {folder}: {', '.join(missing[:4])}")
    if index_path.name.startswith("model.safetensors"):
        for shard in shards:
            names = set(_header(folder / shard))
            absent = [t for t, s in weight_map.items() if s == shard and t not in names]
            if absent:
                raise SurgeryError(f"{shard} lacks tensor {absent[0]} that {index_path.name} places in it")
    return [index_path.name, *shards]


def _header(path: Path) -> dict:
    try:
        tensors, _ = read_safetensors_header(path)
    except SurgeryError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise SurgeryError(f"{path.name} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return tensors


def _auto_map_modules(config: dict, folder: Path) -> set[str]:
    modules = set()
    maps = [config.get("auto_map") or {}]
    tok = folder / "tokenizer_config.json"
    if tok.exists():
        maps.append(_read_json(tok, "tokenizer config").get("auto_map") or {})
    for auto_map in maps:
        for ref in auto_map.values():
            for r in ref if isinstance(ref, list) else [ref]:
                if isinstance(r, str) and "--" not in r:  # "other/repo--module.Class" lives in another repo
                    modules.add(r.rsplit(".", 1)[0])
    return modules


def check_custom_code(config: dict, folder: Path) -> list[str]:
    """Every module auto_map names, and every sibling module those import, must be in the folder and parse."""
    todo, seen = sorted(_auto_map_modules(config, folder)), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = folder / f"{module.replace('.', '/')}.py"
        if not path.is_file():
            raise SurgeryError(f"config auto_map needs {path.name}, which is missing from {folder}")
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as e:
            raise SurgeryError(f"{path.name} (custom code named by auto_map) does not parse: line {e.lineno}: {e.msg}") from None
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(node.module)
    return sorted(f"{m.replace('.', '/')}.py" for m in seen)


def check_hashes(folder: Path, record: dict) -> None:
    """The folder's files match surgery.json, and no weight, index, config or code file was added after."""
    verify_record(folder, record, covered=lambda n: n.endswith(WEIGHT_SUFFIXES + (".py",))
                  or n in ("config.json", *INDEX_FILES))


def check_config_loads(folder: Path, custom_code: bool) -> None:
    """config.json loads in transformers. A config with custom code (auto_map) is not loaded here: that would import
    the folder's configuration module. Its files were checked instead (present, parsing, matching surgery.json)."""
    if custom_code:
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds for a config it cannot use
        raise SurgeryError(f"config.json in {folder} does not load in transformers: {str(e).splitlines()[0]}") from None


def validate_folder(folder: Path) -> Validation:
    """Raise SurgeryError (one line) unless `folder` is a complete checkpoint whose files match surgery.json."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SurgeryError(f"{folder} is not a folder")
    if not (folder / "config.json").is_file():
        raise SurgeryError(f"{folder} has no config.json: not a transformers checkpoint")
    config = _read_json(folder / "config.json", "config")
    record = (check_record(_read_json(folder / RECORD, "record"), folder / RECORD)
              if (folder / RECORD).exists() else None)
    weights = check_weights(folder)
    code = check_custom_code(config, folder)
    if record is not None:
        check_hashes(folder, record)
    check_config_loads(folder, has_custom_code(folder))
    return Validation(folder, config, record, weights, code)
