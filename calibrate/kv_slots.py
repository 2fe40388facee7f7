"""Batched KV caches with per-row lengths, and the prompt prefix every loop of a request starts from.

A speculative-decoding batch holds rows that accept different numbers of drafts each step, so the rows'
lengths drift apart. `SlotCache` keeps one transformers DynamicCache per model with right-padded chunks, a
validity mask per slot and explicit position ids: rolling back is marking a row's slots beyond its kept
length invalid, then cropping the cache to the longest kept row. Slots rejected by some rows while others
kept theirs remain as masked holes (attention ignores them) until they outgrow a quarter of the longest
row; then the rows are packed (`SlotCache.pack`). Finished rows leave the batch (`select`).

`prefill` runs each prompt once (`Prefix`); every loop over that prompt, at any k and under any speculator,
starts from a copy of its row (`Prefix.start`), so a sweep pays for a prompt once.

Whole trajectories (`ConversationCache`): a conversation's next prompt extends its previous one (the
recorded answer and the tool output are appended), so each conversation keeps the KV cache of its last
prompt and the next prompt prefills only what follows their longest common token prefix. The common
prefix need not be the whole previous prompt (a template may rewrite the past: dropped reasoning, a
left-truncated window): reuse falls back to the common part, down to nothing. Whatever runs after a
prompt (the target's generated response, drafts, a teacher-forced pass over a response) runs on copies or
branches (`Prefix.start`, `Prefix.branch`), so what a conversation keeps is its recorded prefix alone.
Nothing here writes a cache tensor in place (transformers' DynamicLayer concatenates, crops by slicing, and
`SlotCache.pack` / `select` gather), which is why a computed prompt's tensors are shared, never copied,
between the conversation, its `Prefix` and a one-row loop cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from calibrate.target_features import TargetFeatures, TargetNeeds, select_features

# Tokens fed per forward pass when a prompt is prefilled: bounds the attention mask and the hidden states a
# pass holds (a chunk of C tokens over a cache of L keeps a C x (L + C) mask; every layer's C x H hidden
# state when features are asked for), at no measurable cost in throughput on CPU.
PREFILL_CHUNK = 2048

# model_type -> why its requests cannot share a batch in this process. A batch pads shorter prompts (on the
# right in SlotCache, on the left in batched generation); attention that reads its cache by slot rather than
# through the mask (a sliding window counted in slots, keys compressed over blocks of slots) then gives a
# padded row another context than its own. Measured on a tiny DeepSeek-V4 (tests/test_mtp_deepseek_v4.py,
# `test_a_padded_row_sees_another_context`): a 12- and a 5-token prompt prefilled side by side match each
# alone, but the next token of the shorter row differs. Rows of one prompt (its loops at several k) start
# equal and are tested exact.
ONE_ROW: dict[str, str] = {
    "deepseek_v4": "its sliding-window attention and compressed keys (HCA / CSA) read the cache by slot, so a "
                   "request padded beside a longer one sees another context",
}


def check_batch(model: torch.nn.Module, batch_size: int) -> None:
    """Refuse batching requests in this process for a target whose cache reads slots, not the mask (ONE_ROW)."""
    config = getattr(model, "config", None)
    model_type = config.get_text_config().model_type if config is not None else None
    if batch_size > 1 and model_type in ONE_ROW:
        raise ValueError(f"target model type {model_type!r}: {ONE_ROW[model_type]}; run it in process with "
                         "[run] batch_size = 1")


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


def cache_of(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache | None:
    """A DynamicCache holding these (keys, values) tensors themselves: `DynamicCache(ddp_cache_data=...)`
    would copy each into a fresh tensor, and nothing here writes one in place (module docstring)."""
    if not layers:
        return None
    cache = DynamicCache()
    for keys, values in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


@dataclass
class Computed:
    """One prompt run through one model: its tokens, its KV cache ((keys, values) per layer, (1, heads, n,
    dim) each), the logits after its last token and, when asked for, the target's features of its positions."""

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    last_logits: torch.Tensor  # (V,)
    features: TargetFeatures | None = None

    def kept(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cache of the first n tokens (views)."""
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]


def _cat_features(parts: Sequence[TargetFeatures]) -> TargetFeatures:
    """Features of consecutive runs of positions, as one run."""
    return TargetFeatures({i: torch.cat([p.layers[i] for p in parts]) for i in parts[0].layers},
                          torch.cat([p.last for p in parts]) if parts[0].last is not None else None)


@torch.inference_mode()
def run_prompt(model: torch.nn.Module, tokens: Sequence[int], needs: TargetNeeds | None = None,
               after: Computed | None = None, keep: int = 0, chunk: int = PREFILL_CHUNK) -> Computed:
    """`tokens` through the model, reusing the first `keep` of them from `after` (a computation whose
    tokens start with those `keep`; 0: none) and prefilling the rest in chunks of `chunk` tokens, alone
    (no padding compute). `after` is left as it was."""
    tokens = list(tokens)
    if not keep < len(tokens):
        raise ValueError(f"reuse of {keep} tokens leaves nothing of a {len(tokens)}-token prompt to run")
    held = after.kept(keep) if after is not None and keep else []
    one = SlotCache(model, 1, cache=cache_of(held), lengths=torch.tensor([keep]))
    feats = [after.features.rows(0, keep)] if needs is not None and needs.any and held else []
    for start in range(keep, len(tokens), chunk):
        logits = one.feed([tokens[start:start + chunk]], logits_to_keep=1, hidden=needs is not None and needs.any)
        if one.hidden is not None:
            feats.append(select_features(one.hidden, needs))
            one.hidden = None
    return Computed(tokens, [(layer.keys, layer.values) for layer in one.cache.layers], logits[0, -1],
                    _cat_features(feats) if feats else None)


@dataclass
class Prefix:
    """The KV caches of a batch of prompts, each distinct prompt computed once: the start of every
    (speculator, k) loop of those requests, which copy their rows of it (`start`). Requests with the same
    prompt (the samples of one request) share one computed row (`stored[j]`).

    `hidden[j]` is the target's features over request j's prompt (the layers it was asked for), when it was
    asked for; `reused[j]` how many of its tokens came from its conversation's cache (0: prefilled whole).
    """

    model: torch.nn.Module
    rows: list[Computed]  # one per distinct prompt
    lengths: torch.Tensor  # (B,) prompt tokens cached per request
    last_logits: torch.Tensor  # (B, V): the logits after each full prompt
    hidden: list[TargetFeatures | None]
    stored: torch.Tensor  # (B,) int64: the row of `rows` that holds request j's prompt
    reused: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    @classmethod
    def of(cls, model: torch.nn.Module, rows: list[Computed], stored: Sequence[int],
           reused: Sequence[int] | None = None) -> Prefix:
        """The batch whose request j's prompt is rows[stored[j]] (and took reused[j] tokens from a cache)."""
        device = model_device(model)
        index = torch.tensor(list(stored), dtype=torch.int64, device=device)
        return cls(model, rows, torch.tensor([len(rows[j].tokens) for j in stored], dtype=torch.int64, device=device),
                   torch.stack([r.last_logits for r in rows]).index_select(0, index),
                   [rows[j].features for j in stored], index,
                   torch.tensor(list(reused) if reused is not None else [0] * len(stored), dtype=torch.int64))

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) of every distinct prompt, (distinct, heads, longest, dim), zero-padded."""
        slots = max(len(r.tokens) for r in self.rows)
        return [(_pad_stack([r.layers[i][0] for r in self.rows], slots), _pad_stack([r.layers[i][1] for r in self.rows], slots))
                for i in range(len(self.rows[0].layers))]

    def start(self, rows: torch.Tensor) -> SlotCache:
        """A loop cache for the given requests (a request may appear more than once): their rows, padded to the
        longest (a one-row cache shares its prompt's tensors: nothing writes them, module docstring)."""
        rows = rows.to(self.lengths.device)
        held = self.stored.index_select(0, rows).tolist()
        lengths = self.lengths.index_select(0, rows)
        slots = int(lengths.max()) if len(held) else 0
        layers = [(_pad_stack([self.rows[h].layers[i][0] for h in held], slots),
                   _pad_stack([self.rows[h].layers[i][1] for h in held], slots))
                  for i in range(len(self.rows[0].layers))] if held else []
        return SlotCache(self.model, len(held), cache=cache_of(layers), lengths=lengths)

    @torch.inference_mode()
    def branch(self, request: int, tokens: Sequence[int], needs: TargetNeeds | None = None,
               ) -> tuple[torch.Tensor | None, TargetFeatures | None]:
        """Feed `tokens` after request `request`'s prompt on a branch that is dropped (the prompt's cache is
        left as it was): the logits at every fed position (n, V) (None when `needs` asks for features, which
        are then returned instead). The teacher-forced pass over a response, at the cost of the response."""
        one = self.start(torch.tensor([request]))
        features = needs is not None and needs.any
        logits = one.feed([list(tokens)], logits_to_keep=1 if features else 0, hidden=features)[0]
        if features:
            return None, select_features(one.hidden, needs)
        return logits, None


@torch.inference_mode()
def prefill(model: torch.nn.Module, prompts: Sequence[Sequence[int]], needs: TargetNeeds | None = None) -> Prefix:
    """Run every distinct prompt through the model once, alone (no padding compute): a request's samples
    repeat its prompt, which is computed once for all of them. With `needs`, the target's features over each
    prompt are kept (those layers only).

    The whole prompt is cached, so every loop begins by sampling its first token from `last_logits` and
    its first draft step feeds that token alone."""
    row_of: dict[tuple[int, ...], int] = {}
    rows: list[Computed] = []
    for prompt in prompts:
        if tuple(prompt) not in row_of:
            row_of[tuple(prompt)] = len(rows)
            rows.append(run_prompt(model, prompt, needs))
    return Prefix.of(model, rows, [row_of[tuple(p)] for p in prompts])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


class ConversationCache:
    """Per conversation, the KV cache (and the features asked for) of its last prompt in one model: the
    recorded prefix the conversation's next turn extends (module docstring).

    `prefix(conversations, prompts)` is `prefill` for one batch of turns: a turn reuses the longest common
    token prefix of its prompt with its conversation's previous one (all but the last token, whose logits a
    turn needs, when the prompt is no longer than what is held) and prefills the rest. Conversations that are
    not in the batch are dropped, so memory is bounded by the batch's conversations, not by the dataset.
    `prefilled` and `reused` count the prompt tokens run and taken from a cache."""

    def __init__(self, model: torch.nn.Module, needs: TargetNeeds | None = None, chunk: int = PREFILL_CHUNK):
        self.model, self.needs, self.chunk = model, needs, chunk
        self.held: dict[str, Computed] = {}
        self.prefilled = self.reused = 0

    def prefix(self, conversations: Sequence[str], prompts: Sequence[Sequence[int]]) -> Prefix:
        if len(conversations) != len(prompts):
            raise ValueError(f"{len(conversations)} conversation ids for {len(prompts)} prompts")
        present = set(conversations)
        self.held = {c: held for c, held in self.held.items() if c in present}
        row_of: dict[tuple[str, tuple[int, ...]], int] = {}
        rows: list[Computed] = []
        reused: list[int] = []
        for conversation, prompt in zip(conversations, prompts):
            key = (conversation, tuple(prompt))
            if key in row_of:
                continue
            row_of[key] = len(rows)
            before = self.held.get(conversation)
            keep = 0 if before is None else common_prefix(before.tokens, prompt)
            if before is not None and keep == len(before.tokens) == len(prompt):
                computed = before  # the same prompt again: nothing to run
            else:
                keep = min(keep, len(prompt) - 1)
                computed = run_prompt(self.model, prompt, self.needs, before, keep, self.chunk)
            self.held[conversation] = computed
            rows.append(computed)
            reused.append(keep)
            self.prefilled += len(prompt) - keep
            self.reused += keep
        return Prefix.of(self.model, rows, [row_of[(c, tuple(p))] for c, p in zip(conversations, prompts)],
                         [reused[row_of[(c, tuple(p))]] for c, p in zip(conversations, prompts)])


# (model, prompts, needs) -> their Prefix: `prefill`, or a batch's conversation caches (`ConversationCaches.prefill`)
Prefill = Callable[[torch.nn.Module, Sequence[Sequence[int]], TargetNeeds | None], Prefix]


@dataclass
class ConversationCaches:
    """The ConversationCache of each model an engine runs (the target, each draft model), made on first use."""

    chunk: int = PREFILL_CHUNK
    of: dict[tuple[int, TargetNeeds | None], ConversationCache] = field(default_factory=dict)

    def prefill(self, conversations: Sequence[str]) -> Prefill:
        """`prefill` for a batch whose request j continues conversation conversations[j]."""
        def run(model: torch.nn.Module, prompts: Sequence[Sequence[int]], needs: TargetNeeds | None = None) -> Prefix:
            key = (id(model), needs if needs is not None and needs.any else None)
            if key not in self.of:
                self.of[key] = ConversationCache(model, key[1], self.chunk)
            return self.of[key].prefix(conversations, prompts)
        return run


def _pad_stack(parts: Sequence[torch.Tensor], slots: int) -> torch.Tensor:
    """(1, heads, n_j, dim) tensors -> one (B, heads, slots, dim) tensor, zero-padded on the right (the one
    tensor itself when it alone fills the slots)."""
    if len(parts) == 1 and parts[0].shape[2] == slots:
        return parts[0]
    out = parts[0].new_zeros((len(parts), parts[0].shape[1], slots, parts[0].shape[3]))
    for j, part in enumerate(parts):
        out[j, :, :part.shape[2]] = part[0]
    return out
