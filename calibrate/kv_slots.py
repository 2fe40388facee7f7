"""Batched KV caches with per-row lengths, and the prompt prefix every loop of a request starts from.

A speculative-decoding batch holds rows that accept different numbers of drafts each step, so the rows'
lengths drift apart. `SlotCache` keeps one transformers DynamicCache per model with right-padded chunks, a
validity mask per slot and explicit position ids: rolling back is marking a row's slots beyond its kept
length invalid, then cropping the cache to the longest kept row. Slots rejected by some rows while others
kept theirs remain as masked holes (attention ignores them) until they outgrow a quarter of the longest
row; then the rows are packed (`SlotCache.pack`). Finished rows leave the batch (`select`).

`prefill` runs each prompt once and stacks the caches (`Prefix`); every loop over that prompt, at any k and
under any speculator, starts from a copy of its row (`Prefix.start`), so a sweep pays for a prompt once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class SlotCache:
    """A batched KV cache with per-row lengths: right-padded chunks, a slot validity mask, crop on rollback."""

    def __init__(self, model: torch.nn.Module, batch: int, cache: DynamicCache | None = None,
                 lengths: torch.Tensor | None = None):
        self.model = model
        self.device = model_device(model)
        self.cache = DynamicCache() if cache is None else cache
        self.lengths = (torch.zeros(batch, dtype=torch.int64, device=self.device) if lengths is None
                        else lengths.to(self.device))  # valid tokens per row
        slots = self.cache.get_seq_length() if cache is not None else 0
        self.valid = torch.arange(slots, device=self.device).unsqueeze(0) < self.lengths.unsqueeze(1)  # (B, slots)
        self.hidden: tuple[torch.Tensor, ...] | None = None  # hidden states of the last feed, when asked

    @torch.inference_mode()
    def feed(self, chunks: Sequence[Sequence[int]], logits_to_keep: int = 0, hidden: bool = False) -> torch.Tensor:
        """Append one chunk of tokens per row (may be empty); returns logits (B, n, V) (n = widest chunk).

        With logits_to_keep=1 only the last column's logits are computed (prefill). With hidden=True the
        feed's hidden states (transformers' tuple, (B, n, H) each) are kept in `self.hidden`."""
        b = len(chunks)
        width = max(len(c) for c in chunks)
        ids = torch.zeros((b, width), dtype=torch.int64)
        new_valid = torch.zeros((b, width), dtype=torch.bool)
        for r, chunk in enumerate(chunks):
            ids[r, :len(chunk)] = torch.as_tensor(chunk, dtype=torch.int64)
            new_valid[r, :len(chunk)] = True
        ids, new_valid = ids.to(self.device), new_valid.to(self.device)
        positions = self.lengths.unsqueeze(1) + torch.arange(width, device=self.device).unsqueeze(0)  # (B, n)
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        out = self.model(input_ids=ids, attention_mask=self.valid.long(), position_ids=positions,
                         cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep,
                         output_hidden_states=hidden)
        self.hidden = out.hidden_states if hidden else None
        self.lengths = self.lengths + new_valid.sum(1)
        return out.logits

    def truncate(self, keep: torch.Tensor) -> None:
        """Keep the first keep[r] valid tokens of each row; crop the slots nobody needs any more, and pack the
        rows when holes (slots some rows rejected while others kept theirs) outgrow the longest row."""
        keep = keep.to(self.device)
        self.valid &= torch.cumsum(self.valid.long(), dim=1) <= keep.unsqueeze(1)
        self.lengths = torch.minimum(self.lengths, keep)
        used = torch.nonzero(self.valid.any(0))
        slots = int(used.max()) + 1 if used.numel() else 0
        if slots < self.valid.shape[1]:
            self.cache.crop(slots - self.valid.shape[1])  # transformers 5: a negative count removes slots
            self.valid = self.valid[:, :slots]
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if slots > longest + longest // 4 + 16:
            self.pack()

    def pack(self) -> None:
        """Move each row's valid slots to the front, in order, and drop the holes behind them.

        Keys were rotated at their own positions when cached and positions are explicit, so moving a slot
        changes nothing but the attention's padding: rows of loops at different k (or requests accepting
        differently) would otherwise carry ever more masked slots, costing attention time and memory."""
        longest = int(self.lengths.max())
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :longest]  # (B, longest)
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", False) or layer.keys.numel() == 0:
                continue
            index = order[:, None, :, None]
            layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1,
                                                               layer.values.shape[3]))
        self.valid = torch.arange(longest, device=self.device).unsqueeze(0) < self.lengths.unsqueeze(1)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (finished loops leave)."""
        rows = rows.to(self.device)
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self.lengths = self.lengths[rows]


@dataclass
class Prefix:
    """The KV caches of a batch of prompts, each distinct prompt computed once and padded to the longest: the
    start of every (speculator, k) loop of those requests, which copy their rows of it (`start`). Requests
    with the same prompt (the samples of one request) share one computed row (`stored[j]`).

    `hidden[j]` is request j's hidden-state tuple ((1, n_j, H) each) over its prompt, when it was asked for.
    """

    model: torch.nn.Module
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), (distinct, heads, slots, dim)
    lengths: torch.Tensor  # (B,) prompt tokens cached per request
    last_logits: torch.Tensor  # (B, V): the logits after each full prompt
    hidden: list[tuple[torch.Tensor, ...] | None]
    stored: torch.Tensor  # (B,) int64: the row of `layers` that holds request j's prompt

    def start(self, rows: torch.Tensor) -> SlotCache:
        """A loop cache for the given requests (a request may appear more than once): a copy of their rows."""
        rows = rows.to(self.lengths.device)
        held = self.stored.index_select(0, rows)
        cache = DynamicCache(ddp_cache_data=((k.index_select(0, held), v.index_select(0, held))
                                             for k, v in self.layers)) if self.layers else None
        return SlotCache(self.model, len(rows), cache=cache, lengths=self.lengths.index_select(0, rows))


@torch.inference_mode()
def prefill(model: torch.nn.Module, prompts: Sequence[Sequence[int]], hidden: bool = False) -> Prefix:
    """Run every distinct prompt through the model once, one at a time (no padding compute), and stack the
    caches (a request's samples repeat its prompt: it is computed once for all of them).

    The whole prompt is cached, so every loop begins by sampling its first token from `last_logits` and
    its first draft step feeds that token alone."""
    row_of: dict[tuple[int, ...], int] = {}
    caches, logits, states = [], [], []
    for prompt in prompts:
        if tuple(prompt) in row_of:
            continue
        row_of[tuple(prompt)] = len(caches)
        one = SlotCache(model, 1)
        logits.append(one.feed([list(prompt)], logits_to_keep=1, hidden=hidden)[0, -1])
        caches.append([(layer.keys, layer.values) for layer in one.cache.layers])
        states.append(one.hidden)
    slots = max(len(p) for p in prompts)
    layers = []
    for i in range(len(caches[0])):
        keys, values = zip(*(c[i] for c in caches))
        layers.append((_pad_stack(keys, slots), _pad_stack(values, slots)))
    device = model_device(model)
    stored = torch.tensor([row_of[tuple(p)] for p in prompts], dtype=torch.int64, device=device)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    return Prefix(model, layers, lengths, torch.stack(logits).index_select(0, stored),
                  [states[j] for j in stored.tolist()], stored)


def _pad_stack(parts: Sequence[torch.Tensor], slots: int) -> torch.Tensor:
    """(1, heads, n_j, dim) tensors -> one (B, heads, slots, dim) tensor, zero-padded on the right."""
    out = parts[0].new_zeros((len(parts), parts[0].shape[1], slots, parts[0].shape[3]))
    for j, part in enumerate(parts):
        out[j, :, :part.shape[2]] = part[0]
    return out
