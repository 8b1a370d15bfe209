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
    compiled = [re.compile(pattern) for pattern in patterns]
    names = [(name, param) for name, param in model.named_parameters(remove_duplicate=False)]
    unused = [p.pattern for p in compiled if not any(p.search(name) for name, _ in names)]
    if unused:
        shown = ", ".join(name for name, _ in names[:4])
        raise ConfigError(
            f"trainable: {', '.join(map(repr, unused))} matches no parameter of the student "
            f"(its names are like {shown}, ...); fix the pattern."
        )
    trained = {id(param) for name, param in names if any(p.search(name) for p in compiled)}
    for param in model.parameters():
        param.requires_grad_(id(param) in trained)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
