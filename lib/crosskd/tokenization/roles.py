"""Roles of special tokens (spec section 1).

Each special has at most one role, taken first from :data:`KNOWN_MARKERS` (marker strings of
the major model families), then from the tokenizer's bos/eos/unk/pad tokens in that order (so
an id that is both eos and pad is eos; ``pad`` is only a dedicated padding token), then from
user overrides. ``eot`` is the token that closes an assistant turn in the model's chat
template (DeepSeek-V3's end-of-sentence token does, so it is ``eot`` there, and DeepSeek-V3
has no ``eos``). If two specials end up with one role, lookups by role use the lowest id.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from crosskd.errors import TokenizerError

ROLES = (
    "bos",
    "eos",
    "eot",
    "eom",
    "pad",
    "unk",
    "turn_start",
    "header_end",
    "system",
    "user",
    "assistant",
    "think_open",
    "think_close",
)

KNOWN_MARKERS: Mapping[str, str] = MappingProxyType(
    {
        # Llama-3
        "<|begin_of_text|>": "bos",
        "<|end_of_text|>": "eos",
        "<|eot_id|>": "eot",
        "<|eom_id|>": "eom",
        "<|start_header_id|>": "turn_start",
        "<|end_header_id|>": "header_end",
        "<|finetune_right_pad_id|>": "pad",
        # ChatML (Qwen, SmolLM) and GPT-2
        "<|im_start|>": "turn_start",
        "<|im_end|>": "eot",
        "<|endoftext|>": "eos",
        # reasoning markers (Qwen3, DeepSeek-R1)
        "<think>": "think_open",
        "</think>": "think_close",
        # DeepSeek-V3: its end-of-sentence token closes every assistant turn in its template.
        "<｜begin▁of▁sentence｜>": "bos",
        "<｜end▁of▁sentence｜>": "eot",
        "<｜▁pad▁｜>": "pad",
        "<｜User｜>": "user",
        "<｜Assistant｜>": "assistant",
        # Phi-3 style role markers
        "<|system|>": "system",
        "<|user|>": "user",
        "<|assistant|>": "assistant",
        "<|end|>": "eot",
        # SentencePiece-era names kept by many BPE tokenizers (Mistral-Nemo tekken)
        "<s>": "bos",
        "</s>": "eos",
        "<unk>": "unk",
        "<pad>": "pad",
        "<|pad|>": "pad",
    }
)


def assign_roles(
    name: str,
    special_ids: Mapping[str, int | None],
    added: dict[int, str],
    overrides: dict[str, str | None],
) -> dict[int, str]:
    """Role of each special (added token id -> role) by the rules in the module docstring.

    ``special_ids``: the tokenizer's ``bos``, ``eos``, ``unk`` and ``pad`` token ids (None or
    absent where unset), taken in that order; ``added``: added-token id -> content;
    ``overrides``: content -> role (None clears it).
    """
    roles = {i: KNOWN_MARKERS[c] for i, c in added.items() if c in KNOWN_MARKERS}
    for role in ("bos", "eos", "unk", "pad"):
        token_id = special_ids.get(role)
        if token_id is not None and token_id in added and token_id not in roles:
            roles[token_id] = role
    by_content = {c: i for i, c in added.items()}
    for content, role in overrides.items():
        if content not in by_content:
            raise TokenizerError(
                f"role override for {content!r}: tokenizer {name!r} has no added token with that "
                f"content; overrides apply to special tokens only."
            )
        if role is None:
            roles.pop(by_content[content], None)
        elif role not in ROLES:
            raise TokenizerError(
                f"role override {content!r}: {role!r} is not a role; roles are {', '.join(ROLES)}."
            )
        else:
            roles[by_content[content]] = role
    return roles
