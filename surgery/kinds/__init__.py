"""The registry of conversion kinds: the one place that knows which kinds exist, their options and their rules.

`surgery convert`'s options (surgery/cli.py), a recipe's `convert:` step (surgery/recipes), the dry-run estimates,
`surgery inspect` and the model card all ask the registry instead of naming kinds. To add a kind, give its package a
kind.py and an options.py like surgery/swa/kind.py and surgery/swa/options.py (an options model deriving from
WriteOptions, base.py here, with the kind's rules as validators, read by the kind and the converter; and a Kind with
its `convert` and cost model) and list it in `_builtin_kinds` below (or `register` it at run time): the command line
gains its flags and `--to` choice, recipes accept its fields, the estimates and inspect use its cost model, and
`convert --list` and `spec_for` its refusals.

`convert_options_model()` is the flat model of the `convert` command and of a recipe's convert step: `to` plus the
union of every kind's fields (a field two kinds share, like `calib`, must be declared alike). Validating it
validates the chosen kind's own model, whose typed options `ConvertOptions.kind_options` then holds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import PrivateAttr, ValidationError, ValidationInfo, create_model, model_validator

from .. import arch
from ..arch import Feature
from ..errors import SurgeryError
from ..options import CliModel, option, spelling
from .base import AttentionShape, CalibrationOptions, Kind, WriteOptions

__all__ = ["AttentionShape", "CalibrationOptions", "ConvertOptions", "Kind", "WriteOptions", "convert_options_model",
           "find_kind", "get_kind", "kind_names", "refusals", "refusals_of", "register", "spec_for", "support_labels",
           "support_markdown", "unregister", "validate_kind_options"]

_KINDS: dict[str, Kind] = {}  # filled with the built-in kinds on the registry's first use (_kinds)
_FLAT: dict[tuple, type] = {}  # the flat convert model, per set of registered kinds


def _builtin_kinds() -> tuple[Kind, ...]:
    """The kinds surgery ships, each from its package's kind.py. Imported on the registry's first use, not when this
    module is, so that a kind's module (which takes its base from surgery.kinds.base, and so runs this module first)
    can be the first one imported."""
    from ..hybrid.kind import HYBRID_KIND
    from ..kv.kind import GQA, MQA
    from ..mla.kind import MLA_KIND
    from ..swa.kind import SWA_KIND
    from ..switchhead.kind import SWITCHHEAD
    from ..talking_heads.kind import TALKING_HEADS

    return MQA, GQA, TALKING_HEADS, SWITCHHEAD, MLA_KIND, SWA_KIND, HYBRID_KIND


def _kinds() -> dict[str, Kind]:
    """The registered kinds by name: the built-in ones, in this order, then those registered since."""
    if not _KINDS:
        _KINDS.update((kind.name, kind) for kind in _builtin_kinds())
    return _KINDS


def register(kind: Kind) -> Kind:
    _kinds()[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    _kinds().pop(name, None)


def kind_names() -> tuple[str, ...]:
    return tuple(_kinds())


def support_labels() -> tuple[str, ...]:
    """The columns of `surgery convert --list`: every kind's support labels, in registration order, once each."""
    return tuple(refusals())


def refusals() -> dict[str, dict[Feature, object]]:
    """Per support label (a column of `surgery convert --list`, the name a kind's converter gives surgery.arch's
    spec_for), the family features it refuses and why (surgery.arch.refused_trait reads such a table), in
    registration order; kinds sharing a label, like mqa and gqa, declare it alike."""
    return {label: table for k in _kinds().values() for label, table in k.refusals().items()}


def refusals_of(label: str) -> dict[Feature, object]:
    """The features a support label refuses (one line when no registered kind answers to it)."""
    tables = refusals()
    if label not in tables:
        raise SurgeryError(f"no conversion kind answers to {label!r} (known: {', '.join(tables)})")
    return tables[label]


def spec_for(config: dict, label: str | None = None) -> arch.ArchSpec:
    """surgery.arch.spec_for with the refusal table of the kind answering to `label` (None: any family surgery
    knows): the family of `config`, refused in one line when that kind cannot convert it."""
    return arch.spec_for(config, label, None if label is None else refusals_of(label))


def support_markdown() -> str:
    """The families x kinds table of `surgery convert --list` (docs/tasks/convert.md shows it): every registered
    kind's columns, each cell its refusal or its verdict (a kind's `verdict`: what its column says of a family it
    converts; default "yes")."""
    verdicts = {label: k.verdict for k in _kinds().values() if k.verdict for label in k.refusals()}
    return arch.support_markdown(refusals(), verdicts)


def get_kind(name: str) -> Kind:
    try:
        return _kinds()[name]
    except KeyError:
        raise SurgeryError(f"unknown conversion kind {name!r}; choose from {', '.join(_kinds())}") from None


def find_kind(record: dict | None = None, config: dict | None = None) -> Kind | None:
    """The kind that wrote a checkpoint: the one whose config key the config sets (SwitchHead's `switchhead`), else
    surgery.json's `kind`, else the model_type prefix of a converted config."""
    config = config or {}
    # a key set to anything but null or false names the kind (a tampered `kv_lora_rank: 0` is still MLA's, to refuse)
    by_key = next((k for k in _kinds().values() if k.config_key and config.get(k.config_key) is not None
                   and config.get(k.config_key) is not False), None)
    if by_key is not None:
        return by_key
    name = (record or {}).get("kind")
    if isinstance(name, str) and name in _kinds():
        return _kinds()[name]
    model_type = str(config.get("model_type"))
    return next((k for k in _kinds().values() if k.model_type_prefix and model_type.startswith(k.model_type_prefix)),
                None)


class ConvertOptions(CliModel):
    """Base of the flat convert model (see convert_options_model)."""

    _kind_options: Any = PrivateAttr(None)

    @property
    def kind(self) -> Kind:
        return get_kind(self.to)

    @property
    def kind_options(self) -> WriteOptions:
        """The chosen kind's own typed options (validated with the kind's rules)."""
        return self._kind_options


def validate_kind_options(kind: Kind, values: dict, context: dict | None = None) -> WriteOptions:
    """`values` (a superset of the kind's fields) validated into the kind's options model; its first error raised
    as a ValueError with the rule's own message."""
    fields = {k: v for k, v in values.items() if k in kind.options.model_fields}
    try:
        return kind.options.model_validate(fields, context=context)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise ValueError(err["msg"].removeprefix("Value error, ")) from None


def _kind_rules(self, info: ValidationInfo):
    values = {name: getattr(self, name) for name in type(self).model_fields if name in self.model_fields_set}
    kind = get_kind(self.to)
    fields = type(self).model_fields
    for name, value in values.items():  # another kind's option, given: it would do nothing, silently
        if name != "to" and name not in kind.options.model_fields and value != fields[name].default:
            s = spelling(info, type(self))
            raise ValueError(f"{s.flag(name)} does nothing for {s.kind(self.to)} (it is an option of another kind)")
    self._kind_options = validate_kind_options(kind, values, info.context)
    return self


def _field_signature(info) -> tuple:
    return (str(info.annotation), repr(info.default))


def convert_options_model(exclude: tuple[str, ...] = (), extra: dict | None = None,
                          name: str = "ConvertOptions") -> type[ConvertOptions]:
    """The flat options model of `surgery convert`, built from the registered kinds; a recipe's convert step is the
    same model without the fields its runner sets (`exclude`) and with the step's own (`extra`)."""
    key = (name, tuple(exclude), tuple((extra or {}).items()), tuple((k.name, k.options) for k in _kinds().values()))
    if key not in _FLAT:
        fields = {k: v for k, v in _union_fields().items() if k not in exclude}
        _FLAT[key] = create_model(name, __base__=ConvertOptions,
                                  __validators__={"kind_rules": model_validator(mode="after")(_kind_rules)},
                                  **(extra or {}), **fields)
    return _FLAT[key]


def _union_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {"to": (Literal[kind_names()], option(None, "--to", "Target attention.", required=True))}
    seen: dict[str, tuple] = {}
    for model in (WriteOptions, *(k.options for k in _kinds().values())):
        for name, info in model.model_fields.items():
            if name in seen:
                if seen[name] != _field_signature(info):
                    raise TypeError(f"option {name} is declared differently by two conversion kinds")
                continue
            seen[name] = _field_signature(info)
            fields[name] = (info.annotation, info)
    return fields


def options_for(kind: str, **values) -> WriteOptions:
    """A kind's options from keyword values (library callers; rules raise SurgeryError)."""
    k = get_kind(kind)
    try:
        return validate_kind_options(k, values)
    except ValueError as e:
        raise SurgeryError(str(e)) from None


_PLAIN = Kind("source", WriteOptions)  # what a checkpoint no kind wrote answers (MHA / GQA / MQA)


def plain_attention_macs(shape: AttentionShape) -> dict:
    """The attention projections' MACs per token of a checkpoint no kind wrote (MHA / GQA / MQA)."""
    return Kind.attention_macs(_PLAIN, shape, {}, {}, 0)


def plain_kv_cache_values(shape: AttentionShape) -> dict[str, int]:
    """Values each runtime caches per token for a checkpoint no kind wrote (MHA / GQA / MQA)."""
    return _PLAIN.kv_cache_values(shape, {})


def kv_cache_values(shape: AttentionShape, config: dict, record: dict | None = None,
                    context: int | None = None) -> dict[str, int]:
    """Values each runtime caches per token for a checkpoint, averaged over a cache of `context` tokens (sliding
    layers keep their window; None: the model's context): its kind's answer, or the base Kind's when no kind wrote
    it."""
    kind = find_kind(record, config)
    return (kind or _PLAIN).kv_cache_values(shape, config, context)



def check_checkpoint(folder, config: dict, record: dict | None = None, shapes: dict | None = None) -> None:
    """A checkpoint read back by any command (inspect, check, bench, uptrain): its surgery.json against the schema
    (read here when `record` is None; surgery.checkpoint.record.Record), and the kind that wrote it checks its
    config.json against its tensors' shapes (`shapes`: name -> shape; read from the safetensors headers when not
    given), so every command refuses the same inconsistencies in the same words. Nothing more for a plain
    checkpoint."""
    if record is None:
        from ..checkpoint.record import read_record

        record = read_record(folder)
    kind = find_kind(record, config)
    if kind is None:
        return
    if shapes is None:
        from pathlib import Path

        from ..checkpoint.tensors import CheckpointReader

        shapes = {}  # pickle (.bin) weights are not unpickled for this: their config is checked alone
        if any(Path(folder).glob("*.safetensors")) or (Path(folder) / "model.safetensors.index.json").exists():
            with CheckpointReader(folder) as reader:
                shapes = {n: t.shape for n, t in reader.tensors.items()}
    kind.check_checkpoint(config, shapes)
