"""Click options generated from an options model (surgery/options.py), as mergekit's `add_merge_options` does: one
option per field, with the field's flag, aliases, help, default and type (a Literal becomes a choice, a bool a
switch, or `--x/--no-x` when it defaults to True). Only the command line imports this module."""

from __future__ import annotations

import types
import typing
from typing import Any, Iterable, Literal

import click
from pydantic import BaseModel

from .options import cli_meta, validate_options


def _base_type(annotation: Any) -> Any:
    """int | None -> int; Literal stays; list[str] -> str (multiple)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return _base_type(non_none[0]) if len(non_none) == 1 else str
    return annotation


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(_base_type(annotation)) in (list, tuple)


def click_option(model: type[BaseModel], name: str) -> click.Parameter:
    info = model.model_fields[name]
    meta = cli_meta(model, name)
    if meta.get("argument"):
        return click.Argument([name], required=info.is_required())
    base = _base_type(info.annotation)
    multiple = _is_list(info.annotation)
    if multiple:
        base = typing.get_args(base)[0] if typing.get_args(base) else str
    required = info.is_required()
    default = None if required else info.default
    decls = [meta["flag"], *meta["aliases"], name]
    kw: dict[str, Any] = {"help": info.description or None, "required": required}
    if meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    if base is bool:
        if default:
            decls[0] = f"{meta['flag']}/--no-{meta['flag'].removeprefix('--')}"
        else:
            kw["is_flag"] = True
        kw["default"] = bool(default)
    else:
        if typing.get_origin(base) is Literal:
            kw["type"] = click.Choice([str(c) for c in typing.get_args(base)])
        elif base in (int, float):
            kw["type"] = base
        elif meta.get("path"):
            kw["type"] = click.Path(dir_okay=meta["path"] != "file")
        if multiple:
            kw["multiple"] = True
            default = list(default or [])
        if default is not None:  # (an explicit None would count as given: --to would not be required)
            kw["default"] = default
    show = meta.get("show_default")
    kw["show_default"] = show if show is not None else (default is not None and default is not False
                                                        and default != [])
    param = click.Option(decls, **kw)
    param.group = meta.get("group")  # shown under its own heading by GroupedCommand
    return param


def model_options(model: type[BaseModel], exclude: Iterable[str] = (), only: Iterable[str] | None = None):
    """A decorator adding one click option per field of `model` (except `exclude`; or just `only`), in the model's
    field order."""
    skip = set(exclude)
    names = [n for n in model.model_fields if n not in skip and (only is None or n in set(only))]

    def decorate(f):
        for name in reversed(names):
            click.decorators._param_memo(f, click_option(model, name))
        return f

    return decorate


def given(values: dict) -> dict:
    """Of a command's option values, those the user gave (on the command line, or from the environment), not those
    click filled in with their defaults (the model's own): validated from these, the options model's
    `model_fields_set` says what was given, as it does for the Python API's keywords and a recipe's keys. Outside a
    running command (no click context), every value counts as given."""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return dict(values)
    return {k: v for k, v in values.items() if ctx.get_parameter_source(k) not in (None, ParameterSource.DEFAULT)}


def parse_options(model: type[BaseModel], values: dict) -> BaseModel:
    """A command's options model, built once from the option values the user gave (`given`; the defaults are the
    model's); the first broken rule is one `surgery: error:` line (the Python API validates its keywords the same
    way: surgery.options.validate_options)."""
    return validate_options(model, {k: v for k, v in given(values).items() if k in model.model_fields})


class GroupedCommand(click.Command):
    """--help lists the options of each group (a kind's, calibration's) under their own heading, after the common
    ones, as mergekit's PrettyPrintHelp does."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str | None, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                sections.setdefault(getattr(param, "group", None), []).append(record)
        for group, rows in sections.items():
            with formatter.section("Options" if group is None else f"Options: {group}"):
                formatter.write_dl(rows)
