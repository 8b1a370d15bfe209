"""Dataclass configs from YAML files and ``key=value`` overrides.

``load_config(PrepareConfig, "prepare.yaml", ["max_length=4096", "pack=false"])``: the file's
mapping first, then each override (its value parsed as YAML, so ``4096`` is an int, ``false`` a
bool and ``[a, b]`` a list). A dotted key sets one key of a mapping-valued field, at any depth
(``loss.kd_weight=0.5``, ``train.loss.kd_weight=0.5``), keeping its other keys. Unknown
top-level keys are refused with the list of known ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
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
