"""Which of the student's parameters a run trains (``TrainConfig.trainable``): the rest are
frozen before the model is spread over the ranks, so they get no gradient and no optimizer
state."""

from __future__ import annotations

import re

from torch import nn

from crosskd.errors import ConfigError


def freeze_except(model: nn.Module, patterns: list[str]) -> int:
    """Leave ``requires_grad`` on only for the parameters of ``model`` of which a name (any
    name: a tied output layer's weight answers to ``lm_head.weight`` and to
    ``model.embed_tokens.weight``) matches one of the regular expressions ``patterns``
    (``re.search``); ``[]`` trains every parameter. Returns the number of trained elements. A
    pattern that matches no name is a :class:`ConfigError` naming it and some of the names."""
    if not patterns:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    names = list(model.named_parameters(remove_duplicate=False))
    trained = _matched(names, patterns, "trainable", "parameter")
    for param in model.parameters():
        param.requires_grad_(id(param) in trained)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def first_groups(model: nn.Module, patterns: list[str]) -> list[list[nn.Parameter]]:
    """The trained parameters of ``model`` (``requires_grad``) as the optimizer's parameter
    groups: ``[all]`` for ``patterns`` ``[]``; else ``[those of which a name matches one of
    the regular expressions patterns (re.search, any name of a tied parameter), the others]``
    (``TrainConfig.first_trainable``). A pattern that matches no trained parameter, or
    patterns that match all of them, are a :class:`ConfigError` naming them."""
    names = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    trained = list({id(p): p for _, p in names}.values())
    if not patterns:
        return [trained]
    first = _matched(names, patterns, "first_trainable", "trained parameter")
    rest = [p for p in trained if id(p) not in first]
    if not rest:
        raise ConfigError(
            f"first_trainable: {', '.join(map(repr, patterns))} matches every trained parameter, "
            f"so first_steps changes nothing; name only the parameters to train first."
        )
    return [[p for p in trained if id(p) in first], rest]


def _matched(
    names: list[tuple[str, nn.Parameter]], patterns: list[str], key: str, what: str
) -> set[int]:
    """The ids of the parameters of ``names`` (``(name, parameter)``, a tied parameter under
    each of its names) of which a name matches one of ``patterns`` (``re.search``); a pattern
    that matches none is a :class:`ConfigError` naming the config ``key`` and some names."""
    compiled = [re.compile(pattern) for pattern in patterns]
    unused = [p.pattern for p in compiled if not any(p.search(name) for name, _ in names)]
    if unused:
        shown = ", ".join(name for name, _ in names[:4])
        raise ConfigError(
            f"{key}: {', '.join(map(repr, unused))} matches no {what} of the student (the "
            f"names are like {shown}, ...); fix the pattern."
        )
    return {id(param) for name, param in names if any(p.search(name) for p in compiled)}
