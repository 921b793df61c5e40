"""The registry of conversion kinds: the one place that knows which kinds exist, their options and their rules.

`surgery convert`'s options (surgery/cli.py), a recipe's `convert:` step (surgery/recipes), the dry-run estimates,
`surgery inspect` and the model card all ask the registry instead of naming kinds. To add a kind, give its package a
kind.py like surgery/kv/kind.py or surgery/swa/kind.py (an options model deriving from WriteOptions, base.py here,
with the kind's rules as validators, and a Kind with its `convert` and cost model) and `register` it below: the
command line gains its flags and `--to` choice, recipes accept its fields, and the estimates and inspect use its cost
model.

`convert_options_model()` is the flat model of the `convert` command and of a recipe's convert step: `to` plus the
union of every kind's fields (a field two kinds share, like `calib`, must be declared alike). Validating it
validates the chosen kind's own model, whose typed options `ConvertOptions.kind_options` then holds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import PrivateAttr, ValidationError, ValidationInfo, create_model, model_validator

from .. import arch
from ..errors import SurgeryError
from ..model_types import CONVERTED_PREFIXES
from ..options import CliModel, option, spelling
from .base import AttentionShape, CalibrationOptions, Kind, WriteOptions
from ..hybrid.kind import HYBRID_KIND  # each kind in its own package: surgery/<kind>/kind.py
from ..kv.kind import GQA, MQA
from ..mla.kind import MLA_KIND
from ..swa.kind import SWA_KIND
from ..switchhead.kind import SWITCHHEAD
from ..talking_heads.kind import TALKING_HEADS

__all__ = ["AttentionShape", "CalibrationOptions", "ConvertOptions", "Kind", "WriteOptions", "convert_options_model",
           "find_kind", "get_kind", "kind_names", "register", "unregister", "validate_kind_options"]

_KINDS: dict[str, Kind] = {}
_FLAT: dict[tuple, type] = {}  # the flat convert model, per set of registered kinds


def register(kind: Kind) -> Kind:
    _KINDS[kind.name] = kind
    if kind.model_type_prefix:
        CONVERTED_PREFIXES[kind.name] = kind.model_type_prefix
    _hand_refusals_to_arch()
    return kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)
    CONVERTED_PREFIXES.pop(name, None)
    _hand_refusals_to_arch()


def _hand_refusals_to_arch() -> None:
    """surgery.arch answers `spec_for(config, label)` and `convert --list` from what the registered kinds refuse
    (kinds sharing a label, like mqa and gqa, declare it alike)."""
    arch.REFUSALS.clear()
    arch.REFUSALS.update({label: table for k in _KINDS.values() for label, table in k.refusals().items()})
    arch.VERDICTS.clear()
    arch.VERDICTS.update({label: k.verdict for k in _KINDS.values() if k.verdict for label in k.refusals()})


for _kind in (MQA, GQA, TALKING_HEADS, SWITCHHEAD, MLA_KIND, SWA_KIND, HYBRID_KIND):
    register(_kind)


def kind_names() -> tuple[str, ...]:
    return tuple(_KINDS)


def support_labels() -> tuple[str, ...]:
    """The columns of `surgery convert --list`: every kind's support labels, in registration order, once each."""
    return tuple(dict.fromkeys(label for k in _KINDS.values() for label in k.refusals()))


def get_kind(name: str) -> Kind:
    try:
        return _KINDS[name]
    except KeyError:
        raise SurgeryError(f"unknown conversion kind {name!r}; choose from {', '.join(_KINDS)}") from None


def find_kind(record: dict | None = None, config: dict | None = None) -> Kind | None:
    """The kind that wrote a checkpoint: the one whose config key the config sets (SwitchHead's `switchhead`), else
    surgery.json's `kind`, else the model_type prefix of a converted config."""
    config = config or {}
    # a key set to anything but null or false names the kind (a tampered `kv_lora_rank: 0` is still MLA's, to refuse)
    by_key = next((k for k in _KINDS.values() if k.config_key and config.get(k.config_key) is not None
                   and config.get(k.config_key) is not False), None)
    if by_key is not None:
        return by_key
    name = (record or {}).get("kind")
    if isinstance(name, str) and name in _KINDS:
        return _KINDS[name]
    model_type = str(config.get("model_type"))
    return next((k for k in _KINDS.values() if k.model_type_prefix and model_type.startswith(k.model_type_prefix)),
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
    key = (name, tuple(exclude), tuple((extra or {}).items()), tuple((k.name, k.options) for k in _KINDS.values()))
    if key not in _FLAT:
        fields = {k: v for k, v in _union_fields().items() if k not in exclude}
        _FLAT[key] = create_model(name, __base__=ConvertOptions,
                                  __validators__={"kind_rules": model_validator(mode="after")(_kind_rules)},
                                  **(extra or {}), **fields)
    return _FLAT[key]


def _union_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {"to": (Literal[tuple(_KINDS)], option(None, "--to", "Target attention.", required=True))}
    seen: dict[str, tuple] = {}
    for model in (WriteOptions, *(k.options for k in _KINDS.values())):
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
