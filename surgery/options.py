"""Options models that describe their own command-line flags: one pydantic field per option, carrying its flag,
help text and metavar, so that the command line (surgery/clickgen.py) and the YAML recipes (surgery/recipes) are
both generated from the same model and cannot drift apart.

    class ChunkOptions(CliModel):
        chunk_size: int = option(512, "--chunk-size", "Query chunk (memory O(h*chunk*S)).")

A bool field whose default is True becomes `--flag/--no-flag`; one whose default is False an on-switch. The YAML
key of a field is its name (`kv_heads`, `merge`), which is also its first long flag with underscores.

Rules that concern several fields are model validators; their messages name the options through `Spelling`, so
that one rule reads `--to gqa needs --kv-heads N` on the command line and `to: gqa needs kv_heads` in a recipe.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterable

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo


def option(default: Any = None, flag: str | None = None, help: str = "", *, aliases: tuple[str, ...] = (),
           metavar: str | None = None, show_default: bool | None = None, group: str | None = None,
           required: bool = False, path: str | None = None, argument: bool = False) -> Any:
    """A pydantic Field that also says how the command line spells it (`flag`, `aliases`, `metavar`), its help and
    the group of kind-specific options it belongs to. `show_default` defaults to "when the default is not None";
    `path` ("file" or "any") makes the command line check a path; `argument` makes it a positional argument."""
    cli = {"flag": flag, "aliases": list(aliases), "metavar": metavar, "group": group,
           "show_default": show_default, "path": path, "argument": argument}
    if required:
        return Field(..., description=help, json_schema_extra={"cli": cli})
    return Field(default, description=help, json_schema_extra={"cli": cli})


def cli_meta(model: type[BaseModel], name: str) -> dict:
    """How field `name` of `model` is spelled on the command line (a field declared without `option`: --name)."""
    info = model.model_fields[name]
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    meta = dict(extra.get("cli") or {})
    meta["flag"] = meta.get("flag") or "--" + name.replace("_", "-")
    meta.setdefault("aliases", [])
    return meta


class CliModel(BaseModel):
    """Base of every options model: unknown fields are errors (a misspelled recipe key is not silently ignored)."""

    model_config = ConfigDict(extra="forbid")


def validate_options(model: type[BaseModel], values: dict, *, extra_names: Iterable[str] = ()) -> BaseModel:
    """`values` validated into `model`, the one way both front ends turn option values into options: the command line
    (surgery/clickgen.py) and the Python API (surgery/api). A key that is no field of `model` (nor one of
    `extra_names`, taken elsewhere) is refused with the closest option's name; the first broken rule is one line,
    worded as the command line prints it (`--kv-heads: ...`). Raises SurgeryError."""
    from pydantic import ValidationError

    from .errors import SurgeryError

    refuse_unknown(model, values, extra_names)
    try:
        return model.model_validate({k: v for k, v in values.items() if k in model.model_fields})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        message = err["msg"].removeprefix("Value error, ")
        field = next((p for p in err["loc"] if isinstance(p, str) and p in model.model_fields), None)
        if field is not None and err["type"] not in ("value_error", "assertion_error"):
            message = f"{cli_meta(model, field)['flag']}: {message}"
        raise SurgeryError(message) from None


def refuse_unknown(model: type[BaseModel], values: Iterable[str], extra_names: Iterable[str] = ()) -> None:
    """SurgeryError naming the first of `values` (option names) that is no field of `model` nor one of
    `extra_names`, and the closest name that is."""
    import difflib

    from .errors import SurgeryError

    known = [*model.model_fields, *extra_names]
    unknown = [k for k in values if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise SurgeryError(f"unknown option {unknown[0]!r}{hint}")


# ---- how a rule names the options it is about ---------------------------------------------------------------
class Spelling:
    """Option names as the command line writes them: `--to gqa`, `--kv-heads N`."""

    def __init__(self, model: type[BaseModel] | None = None):
        self.model = model

    def flag(self, name: str) -> str:
        if self.model is not None and name in self.model.model_fields:
            return cli_meta(self.model, name)["flag"]
        return "--" + name.replace("_", "-")

    def value(self, name: str) -> str:
        meta = cli_meta(self.model, name) if self.model is not None and name in self.model.model_fields else {}
        return f"{self.flag(name)} {meta.get('metavar') or 'N'}"

    def kind(self, kind: str) -> str:
        return f"--to {kind}"

    def options(self, names: Iterable[str]) -> str:
        return " ".join(self.value(n) for n in names)

    def use(self, kind: str, names: Iterable[str]) -> str:
        return f"{self.kind(kind)} {self.options(names)}"


class YamlSpelling(Spelling):
    """Option names as a recipe writes them: `to: gqa`, `kv_heads`."""

    def flag(self, name: str) -> str:
        return name

    def value(self, name: str) -> str:
        return name

    def kind(self, kind: str) -> str:
        return f"to: {kind}"

    def options(self, names: Iterable[str]) -> str:
        names = list(names)
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"

    def use(self, kind: str, names: Iterable[str]) -> str:
        return f"{self.kind(kind)} with {self.options(names)}"


YAML = YamlSpelling()


def spelling(info: ValidationInfo | None, model: type[BaseModel] | None = None) -> Spelling:
    """The spelling a validator's messages use: a recipe validates with context {"spelling": YAML}."""
    context = info.context if info is not None and isinstance(info.context, dict) else {}
    return context.get("spelling") or Spelling(model)


# ---- options back into a command line -------------------------------------------------------------------------
def command_args(options: BaseModel, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that reproduce `options` on the command line: fields left at their default are omitted."""
    model = type(options)
    skip = set(exclude)
    args: list[str] = []
    for name, info in model.model_fields.items():
        value = getattr(options, name)
        if name in skip or value is None or cli_meta(model, name).get("argument"):
            continue
        if not info.is_required() and value == info.default:
            continue
        flag = cli_meta(model, name)["flag"]
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag.removeprefix("--"))
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            args += [flag, str(v)]
    return args


# ---- options that take one text or several ----------------------------------------------------------------------
def one_or_more(v: Any) -> Any:
    """A recipe's `data: pydoc` is the list of one text."""
    return [v] if isinstance(v, str) else v


Texts = Annotated[list[str], BeforeValidator(one_or_more)]  # repeatable on the command line (`--calib A --calib B`)


def texts_rule(name: str):
    """A field validator for a `Texts` field `name`: at least one text."""
    def rule(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if not v:
            raise ValueError(f"{spelling(info, cls).flag(name)} needs at least one text")
        return v
    return rule


def at_least_one(cls, v: int, info: ValidationInfo) -> int:
    """A field validator (pydantic's `field_validator(*names)(at_least_one)`): the option is a count of at least 1."""
    if v < 1:
        raise ValueError(f"{spelling(info, cls).flag(info.field_name)} must be at least 1, got {v}")
    return v


def env_number(name: str, default: float, unit: str, maximum: float = 1e15) -> float:
    """Environment variable `name` as a finite number from 0 to `maximum` (the numeric options' strictness: `inf`,
    `nan`, a negative number or text is one line naming the variable, never silently clamped); `default` when unset
    or blank."""
    import math
    import os

    from .errors import SurgeryError

    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or not 0 <= number <= maximum:
        raise SurgeryError(f"{name} must be a number of {unit} from 0 to {maximum:g}, not {value!r}")
    return number
