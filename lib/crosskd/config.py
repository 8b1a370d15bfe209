"""Dataclass configs from YAML files and ``key=value`` overrides.

``load_config(PrepareConfig, "prepare.yaml", ["max_length=4096", "pack=false"])``: the file's
mapping first, then each override (its value parsed as YAML, so ``4096`` is an int, ``false`` a
bool and ``[a, b]`` a list). A dotted key sets one key of a mapping-valued field, at any depth
(``loss.kd_weight=0.5``, ``train.loss.kd_weight=0.5``), keeping its other keys. Unknown
top-level keys are refused with the list of known ones.

A command's options are its config's fields: :func:`add_config_options` derives them from the
dataclass (``max_length: int`` is ``--max-length N``, a ``bool`` ``--pack/--no-pack``, a
``list[str]`` a repeated option; the help is the field's docstring, :func:`field_docs`), and
:func:`config_flags` gives the ones the user set as :func:`load_config`'s ``flags``, between
the file and the ``key=value`` overrides. :class:`CommandParser` adds them when the command is
parsed, so building the whole ``crosskd`` parser imports no config module.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import itertools
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import fsspec
import yaml

from crosskd.errors import ConfigError, CrosskdError

T = TypeVar("T")


def require_positive_ints(config: object, keys: Sequence[str], prefix: str = "") -> None:
    """Refuse (:class:`crosskd.errors.ConfigError`, naming the key, after ``prefix``, and the
    value) any of ``config``'s fields ``keys`` that is not an integer >= 1 (a bool is not
    one)."""
    for key in keys:
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{prefix}{key} is {value!r}; it must be an integer >= 1.")


def load_config(
    cls: type[T],
    path: str | None = None,
    overrides: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from the YAML file at ``path`` (any fsspec URI), then explicit ``flags``
    (command-line options), then ``key=value`` overrides, later sources winning. A field typed
    as a list refuses a single value."""
    known = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if path is not None:
        with fsspec.open(path, "r", encoding="utf-8") as fh:
            loaded = yaml.safe_load(fh) or {}
        if not isinstance(loaded, dict):
            raise CrosskdError(f"config {path}: expected a mapping of keys to values at the top.")
        values.update(_checked(loaded, known, f"config {path}"))
    values.update(flags or {})
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CrosskdError(f"override {item!r}: write it as key=value.")
        top, *path = key.strip().split(".")
        value = yaml.safe_load(raw)
        if path:
            _checked({top: None}, known, f"override {item!r}")
            value = merged(values.get(top, {}), _nest(path, value), where=f"override {item!r}")
        values.update(_checked({top: value}, known, f"override {item!r}"))
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise CrosskdError(
            f"{cls.__name__}: {', '.join(missing)} not set; give it in the config file, as a "
            f"flag, or as key=value."
        )
    for f in dataclasses.fields(cls):
        is_list = str(f.type).startswith("list")
        if is_list and f.name in values and not isinstance(values[f.name], list):
            raise CrosskdError(
                f"{cls.__name__}.{f.name} takes a list, got {values[f.name]!r}; write "
                f"{f.name}=[a, b] (or a YAML list)."
            )
    return cls(**values)


def merged(base: Any, update: Mapping[str, Any], where: str = "config") -> dict[str, Any]:
    """``base`` (a mapping, or None for none) updated by ``update`` key by key: where both hold
    a mapping under a key, the two are merged the same way, so ``{"train": {"steps": 5}}`` over
    ``{"train": {"lr": 0.1}}`` keeps ``lr``. A non-mapping ``base`` is a
    :class:`CrosskdError` naming ``where``."""
    if base is None:
        base = {}
    if not isinstance(base, Mapping):
        raise CrosskdError(f"{where}: {base!r} is not a mapping, so it has no keys to set.")
    result = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            value = merged(result[key], value, where)
        result[key] = value
    return result


def _nest(path: Sequence[str], value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for the dotted key path ``["a", "b"]``."""
    for key in reversed(path[1:]):
        value = {key: value}
    return {path[0]: value}


def _checked(values: Mapping[str, Any], known: set[str], where: str) -> dict[str, Any]:
    unknown = sorted(set(values) - known)
    if unknown:
        raise CrosskdError(
            f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}."
        )
    return dict(values)


def default_cache_dir() -> Path:
    """Where crosskd keeps what it builds or copies (zoo tokenizers and models, remote models):
    ``$CROSSKD_CACHE_DIR`` or ``~/.cache/crosskd``."""
    return Path(os.environ.get("CROSSKD_CACHE_DIR") or Path.home() / ".cache" / "crosskd")


@functools.cache
def field_docs(cls: type) -> Mapping[str, str]:
    """The attribute docstrings of the dataclass ``cls`` by field name: the string literal
    right after each field in the class body (read with :mod:`ast` from its source), its
    whitespace collapsed to single spaces. Read once per class."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return MappingProxyType(docs)


def _option_type(annotation: object) -> tuple[type, bool] | None:
    """The command-line form of a field annotated ``annotation`` (a string under
    ``from __future__ import annotations``, or the type): ``(int, False)`` for ``int`` or
    ``int | None`` (likewise ``float``, ``str``, ``bool``), ``(str, True)`` for ``list[str]``
    (a repeatable option); None for anything else (a mapping, a nested config, a list of
    mappings), which has no option."""
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    kinds = [part.strip() for part in text.split("|") if part.strip() != "None"]
    if kinds == ["list[str]"]:
        return str, True
    scalars = {"int": int, "float": float, "str": str, "bool": bool}
    if len(kinds) == 1 and kinds[0] in scalars:
        return scalars[kinds[0]], False
    return None


def add_config_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add to ``parser`` one option per field of the dataclass ``cls`` typed ``int``,
    ``float``, ``str`` or ``bool`` (each also ``| None``) or ``list[str]``: field
    ``max_length`` is ``--max-length``, a ``bool`` is ``--pack/--no-pack``, a ``list[str]`` is
    repeated (``--models A --models B``); the help is the field's docstring
    (:func:`field_docs`) and default. Every option defaults to None, so one not given is left
    out of :func:`config_flags`. Then the positional ``key=value`` overrides, whose help names
    the fields without an option (mappings, nested configs: set in the file or as
    ``key=value``). A field with an option but no docstring is a :class:`TypeError`."""
    docs = field_docs(cls)
    group = parser.add_argument_group(
        f"{cls.__name__} fields",
        "each option sets the field of its name (--max-length sets max_length; a list field's "
        "option is repeated, one item each), over the config file; key=value overrides win "
        "over both",
    )
    without = []
    for f in dataclasses.fields(cls):
        form = _option_type(f.type)
        if form is None:
            without.append(f.name)
            continue
        if f.name not in docs:
            raise TypeError(
                f"{cls.__name__}.{f.name} has no docstring; write one as a string literal "
                f"right after the field (it is the option's --help)."
            )
        kind, repeated = form
        option = f"--{f.name.replace('_', '-')}"
        default = _default_text(f)
        text = f"{docs[f.name]} ({'repeatable; ' if repeated else ''}{default})"
        text = text.replace("%", "%%")
        if kind is bool:
            group.add_argument(
                option,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=text,
            )
        else:
            group.add_argument(
                option,
                dest=f.name,
                type=kind,
                action="append" if repeated else "store",
                default=None,
                help=text,
            )
    rest = (
        f"; without an option, set in the file or here: {', '.join(without)} (a dotted "
        f"NAME.KEY=VALUE sets one key of a mapping)"
        if without
        else ""
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help=(
            f"any {cls.__name__} field, over the file and the options (the value is YAML: "
            f"4096, false, [a, b]){rest}"
        ).replace("%", "%%"),
    )


def config_flags(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options of ``cls``'s fields (:func:`add_config_options`) given in ``args``, by field
    name: :func:`load_config`'s ``flags``. An option not given is left out, so the config
    file's value stands."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if _option_type(f.type) is not None and getattr(args, f.name) is not None
    }


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` from a command's parsed ``args``: its ``--config`` file, then the field options
    given (:func:`config_flags`), then its ``key=value`` overrides (:func:`load_config`)."""
    return load_config(cls, args.config, args.overrides, flags=config_flags(args, cls))


def flag_overrides(flags: Mapping[str, Any]) -> list[str]:
    """``flags`` as ``key=value`` overrides that :func:`load_config` reads back as the same
    values (each value written as YAML, so the string ``"4096"`` stays a string): for a command
    line passed on to another process (``crosskd train --nproc-per-node``'s workers)."""
    return [f"{key}={_yaml_text(value)}" for key, value in flags.items()]


def _yaml_text(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True)
    return text.removesuffix("\n...\n").removesuffix("\n")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return f"default: {_yaml_text(value) if isinstance(value, bool) else repr(value)}"


class CommandParser(argparse.ArgumentParser):
    """An argument parser for a command with a config class, ``config="crosskd.data.prepare:
    PrepareConfig"`` (``module:Class``): ``--config FILE`` (a YAML file of the class's keys)
    at once, and the class's options (:func:`add_config_options`) when it first parses. So
    building ``crosskd``'s whole parser imports no config module (some import torch), and a
    command imports only its own."""

    def __init__(self, *args: Any, config: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._config = config
        if config is not None:
            self.add_argument("--config", help=f"YAML file with {config.partition(':')[2]} keys")

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Add the config's options (the first time), then parse as
        :meth:`argparse.ArgumentParser.parse_known_args`."""
        if self._config is not None:
            module, _, name = self._config.partition(":")
            self._config = None
            add_config_options(self, getattr(importlib.import_module(module), name))
        return super().parse_known_args(args, namespace)
