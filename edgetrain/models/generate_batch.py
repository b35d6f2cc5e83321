"""Greedy answers to many prompts at once, for a torch decoder: one forward a new token for the whole batch.

What it is for: the personaliser's retain set (edgetrain.personalise.retain) asks the base model for its own
answers to a few dozen prompts. One prompt at a time, a 4-bit SmolLM2-135M made about 7 tokens a second
here, nearly all of it dequantising the packed weights, which a batch of prompts shares.

Prompts of different lengths are padded on the left. Padding keys are masked out, and a padding query
attends to itself only (a query that sees no key at all would give NaN, which its value would carry
into the next block). Every row uses positions 0..L-1 for its RoPE. Attention scores under RoPE depend only
on the distance between query and key, so a row shifted right by its padding gets the same scores as
unpadded (tests/models/test_generate_batch.py checks the logits against one prompt at a time).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from edgetrain.models.generate import KVCache, block_cached, check_prompt
from edgetrain.models.token_loss import is_block_decoder
from edgetrain.registry import EdgetrainError


def _forward(model: nn.Module, token_ids: torch.Tensor, cache: KVCache, visible: torch.Tensor) -> torch.Tensor:
    """Logits of the last position of each row [batch, vocab]; the cache grows by `token_ids`' positions."""
    if not cache.keys:
        cache.keys, cache.values = [None] * len(model.blocks), [None] * len(model.blocks)
    start = cache.length
    h = model.embed(token_ids)
    for index, block in enumerate(model.blocks):
        h = block_cached(block, h, cache, index, start, visible)
    return model.head(h[:, -1])


def prompt_mask(lengths: Sequence[int], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_is_token [batch, width], visible [batch, 1, width, width]) for prompts left-padded to `width`:
    causal, never a padding key, and each padding query sees itself (see the module docstring)."""
    positions = torch.arange(width, device=device)
    key_is_token = positions[None, :] >= (width - torch.tensor(list(lengths), device=device))[:, None]
    causal = positions[None, :] <= positions[:, None]
    visible = (causal[None] & key_is_token[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None]
    return key_is_token, visible[:, None]


# The key/value cache holds (prompt + answer) positions x blocks x 2 x the key/value width for every row: for
# SmolLM2-135M in fp32 about 5 MB a row at 60 + 48 positions, so 32 prompts at once held 159 MB, and the
# personaliser's retain set made `personalise run` peak 75 MiB above the same run without it. Prompts are
# answered in groups whose cache stays within this budget; each group shares one dequantisation a token. At
# 48 MiB that run peaked 2 MiB above the unguarded one in 1.05x the time of one batch (24 MiB: +1 MiB, 1.7x).
CACHE_BUDGET_BYTES = 48 * 2**20


def cache_bytes_per_row(model: nn.Module, positions: int) -> int:
    """What one row's key/value cache holds at `positions` positions."""
    config = model.config
    itemsize = model.head.norm.weight.element_size()  # the hidden states' dtype, which the cache keeps
    return positions * len(model.blocks) * 2 * config.num_key_value_heads * config.head_dim * itemsize


@torch.no_grad()
def greedy_answers(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   stop_ids: Iterable[int] = (), pad_id: int = 0,
                   interrupted: Callable[[], bool] | None = None,
                   cache_budget_bytes: int = CACHE_BUDGET_BYTES) -> list[list[int]]:
    """The greedy continuation of each prompt (token ids), at most `max_new_tokens` each, cut before the first
    of `stop_ids` (not included). `interrupted()` is read before every new token: when it says so, this
    raises InterruptedError and nothing is returned. Prompts of similar length are answered together, as many
    at once as keep the key/value cache within `cache_budget_bytes` (at least one)."""
    if not is_block_decoder(model):
        raise EdgetrainError(f"greedy_answers needs a torch decoder language model; got {type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise EdgetrainError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if not prompts:
        return []
    for prompt in prompts:
        check_prompt(prompt, model.config.vocab_size)
    answers: list[list[int]] = [[] for _ in prompts]
    by_length = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
    start = 0
    while start < len(by_length):
        # The longest prompt of a group sets its width; shorter ones first keep the groups' padding small.
        count = 1
        while start + count < len(by_length):
            width = len(prompts[by_length[start + count]])
            if (count + 1) * cache_bytes_per_row(model, width + max_new_tokens) > cache_budget_bytes:
                break
            count += 1
        group = by_length[start:start + count]
        for index, answer in zip(group, _answer_group(model, [prompts[i] for i in group], max_new_tokens,
                                                      set(stop_ids), pad_id, interrupted)):
            answers[index] = answer
        start += count
    return answers


def _answer_group(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, stops: set[int],
                  pad_id: int, interrupted: Callable[[], bool] | None) -> list[list[int]]:
    """greedy_answers for prompts answered in one batch."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    token_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        token_ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
    key_is_token, visible = prompt_mask([len(p) for p in prompts], width, device)
    cache = KVCache()
    was_training = model.training
    model.eval()
    answers: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # the prompt each row of the batch answers; finished ones are dropped
    try:
        logits = _forward(model, token_ids, cache, visible)
        while True:
            if interrupted is not None and interrupted():
                raise InterruptedError("greedy_answers was interrupted")
            chosen = logits.argmax(dim=-1).tolist()
            keep = []
            for at, row in enumerate(rows):
                if chosen[at] in stops:
                    continue
                answers[row].append(chosen[at])
                if len(answers[row]) < max_new_tokens:
                    keep.append(at)
            if not keep:
                return answers
            if len(keep) < len(rows):  # a finished row costs nothing more: drop it from the batch and cache
                index = torch.tensor(keep, device=device)
                cache.keys = [k.index_select(0, index) for k in cache.keys]
                cache.values = [v.index_select(0, index) for v in cache.values]
                key_is_token = key_is_token.index_select(0, index)
                rows, chosen = [rows[at] for at in keep], [chosen[at] for at in keep]
            key_is_token = torch.cat([key_is_token, torch.ones(len(rows), 1, dtype=torch.bool, device=device)], 1)
            step = torch.tensor(chosen, dtype=torch.long, device=device)[:, None]
            logits = _forward(model, step, cache, key_is_token[:, None, None, :])
    finally:
        model.train(was_training)


def answer_ids(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, stop_ids: Iterable[int] = (),
               pad_id: int = 0, interrupted: Callable[[], bool] | None = None) -> list[list[int]]:
    """greedy_answers for a torch decoder; another framework's model answers one prompt at a time through
    its backend's generate_ids (edgetrain.models.generate), `interrupted` read between prompts."""
    if isinstance(model, nn.Module):
        return greedy_answers(model, prompts, max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                              interrupted=interrupted)
    from edgetrain.models.generate import generate_ids

    stops = set(stop_ids)
    answers = []
    for prompt in prompts:
        if interrupted is not None and interrupted():
            raise InterruptedError("answer_ids was interrupted")
        ids = generate_ids(model, list(prompt), max_new_tokens, stop_ids=stops)
        answers.append(ids[:-1] if ids and ids[-1] in stops else ids)
    return answers
