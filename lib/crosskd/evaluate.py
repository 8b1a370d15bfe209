"""Held-out bits per byte of a causal LM: comparable across tokenizers.

Each sequence is scored alone (right-padded batches by a token budget, attention masked); the
negative log likelihood of every token after the first, in bits (nats / ln 2), is divided by
those tokens' UTF-8 bytes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from crosskd.teacher.scoring import budget_batches


@torch.no_grad()
def bits_per_byte(
    model: torch.nn.Module,
    sequences: list[np.ndarray],
    token_bytes: np.ndarray,
    *,
    device: torch.device | str = "cpu",
    token_budget: int = 4096,
) -> float:
    """Bits per byte of ``model`` on ``sequences`` (int token ids ``[L_i]`` each);
    ``token_bytes`` int ``[V]``: each id's UTF-8 length."""
    was_training = model.training
    model.eval()
    bits, n_bytes = 0.0, 0
    for group in budget_batches([len(s) for s in sequences], token_budget):
        batch = [sequences[i] for i in group]
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, seq in enumerate(batch):
            ids[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[b, : len(seq)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        keep = mask[:, 1:].bool()
        bits -= lp[keep].double().sum().item() / math.log(2)
        n_bytes += int(token_bytes[ids[:, 1:][keep].cpu().numpy()].sum())
    model.train(was_training)
    return bits / n_bytes if n_bytes else float("nan")
