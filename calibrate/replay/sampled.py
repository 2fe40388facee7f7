"""Sampled loop: real batched speculative decoding, measuring acceptance at temperature > 0.

At temperature > 0 there is no replay shortcut: the target's response depends on the random draws, so the
loop really runs speculative decoding: draft k tokens, verify the k + 1 positions in ONE target forward
pass, accept by rejection sampling (calibrate.kernels), roll both KV caches back past the rejected tokens,
repeat. The first pass only prefills and emits the first token (no drafts), as serving engines do. Its
output is exactly target-distributed, and each step's accepted count is recorded with the
shared step rule (calibrate.replay.steps.step_accepted), so the histograms mean the same thing as the
greedy replay-once engine's. It also records the analytic expected acceptance of each step (running
product of min(1, p/q), computed by the verification kernel): same mean as the realised counts, lower
variance. At temperature 0 it is a plain greedy speculative decoder (engine = "loop").

Entry points (with already-tokenised prompts):

    swept = run_sweep(target_model, [spec_a, spec_b], prompts, draft_lens=[1, 3, 5], temperature=0.7,
                      top_p=0.95, top_k=None, max_new_tokens=1024, eos_token_ids={eos}, seed=0,
                      segment_labeller=labeller, verify_backend="auto", loop_rows=8)   # what LoopEngine calls
    swept[s][i].counts[k]         -> StepCounts of request i at draft length k under speculator s
    swept[s][i].tokens[k]         -> the token ids that loop generated (EOS included when it ended)
    swept[s][i].finish_reason[k]  -> "eos" | "length"
    run_sampled(target_model, speculator, prompts, ..., batch_size=8)[i]  -> the same for one speculator

Each (speculator, k) is its own loop (at temperature > 0 the responses differ per k), but a sweep pays for
the prompt once: the target prefills each prompt once (`prefill`, with the hidden states any speculator
needs), each draft model once, and each request's first token (sampled from the prompt's logits, keyed by
position 0) is drawn once; every loop starts from a copy of its request's cache rows (`Prefix.start`).
Loops of one speculator run `loop_rows` at a time as one batch, ordered by (k, request), so loops of the
same request at neighbouring k share a batch: each row drafts its own k_r and verifies 1 + k_r positions.
`speculator` is
- a draft model: DraftModelSpeculator (its `.draft.model` is used) or a bare transformers causal
  LM (e.g. the target itself, for self-speculation); it drafts in batch with its own KV cache, sampling
  from softmax(logits / T) (no top-k / top-p: any q is exact, this one is what vLLM's drafters use), and
  hands q to the verifier; at temperature 0 it drafts its argmax;
- any other Speculator (n-gram, suffix, EAGLE-3, ...): per loop id (distinct per (request, k)) `start` with
  the prompt, `extend` with the first token, then `draft(loop_id, k, temperature, generator)` per step,
  `extend` with each verified block and `finish`; when it declares `needs`, the target's hidden states of
  the positions each pass verified come with `start` / `extend` (calibrate.speculators.base). Its `probs`
  are used when given, else q = one-hot. Proposals may be shorter than k.

Randomness is counter-based (calibrate.kernels.rng), keyed by (seed, request key (`request_keys`, default
the index in `prompts`), position in the response, purpose) for both the draft samples and the
verification, so a loop's outcome does not depend on the loops batched with it, on the prefill being
shared, or on the backend (a test runs each loop alone and the whole sweep, and compares the counts). A
speculator that samples with a torch generator gets one per loop, seeded by (seed, request key, k).

KV caches (`_SlotCache`): one transformers DynamicCache per model, right-padded chunks, a validity mask per
slot and explicit position ids. Rolling back = marking a row's slots beyond its kept length invalid,
then cropping the cache to the longest kept row. Slots rejected by some rows while others kept theirs
remain as masked holes (attention ignores them) until they outgrow a quarter of the longest row; then the
rows are packed (`_SlotCache.pack`). Finished loops leave the batch (DynamicCache.batch_select_indices).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from calibrate.kernels import rng, verify_greedy, verify_rejection
from calibrate.kernels.reference import VerifyOutput, sampling_probs
from calibrate.replay.counts import StepCounts
from calibrate.replay.experts import ExpertRecorder, ExpertTrace
from calibrate.replay.steps import step_accepted
from calibrate.speculators.base import Speculator, TargetFeatures, TargetNeeds, select_features


# Verification rules at temperature > 0. Both emit exactly target-distributed tokens; they differ in AL.
# - "probabilistic": drafts sampled from the drafter's q, accepted with min(1, p/q), residual max(p - q, 0)
#   (Leviathan et al. 2023);
# - "target-only": greedy (argmax) drafts, accepted with probability p_target(draft), i.e. q one-hot, residual
#   p without the draft: vLLM v1's model runner (draft_probs None) and SGLang's EAGLE
#   (tree_speculative_sampling_target_only). Its expected acceptance is the running product of p(d_i).
VERIFICATION_RULES = ("probabilistic", "target-only")


@dataclass
class SampledResult:
    """One request's outcome, per draft length k (each k is its own generation at temperature > 0)."""

    counts: dict[int, StepCounts] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish_reason: dict[int, str] = field(default_factory=dict)  # "eos" | "length"
    experts: dict[int, ExpertTrace] = field(default_factory=dict)  # when run_sweep was given an ExpertRecorder


@dataclass
class StepRecord:
    """One step of one request, as the step rule saw it."""

    start: int  # response position of the step's first emitted token
    accepted: int | None  # step_accepted(...); None when censored by max_new_tokens
    tokens: int  # tokens this step added to the response
    proposed: int  # drafts the speculator proposed
    expected: float  # analytic E[accepted drafts | proposed drafts]
    is_step: bool = True  # False for the prefill pass's first token (calibrate.replay.steps)


def record_step(emitted: Sequence[int], a_true: int, k: int, generated: int, max_new_tokens: int,
                eos_token_ids: set[int], expected: float, proposed: int) -> tuple[StepRecord, list[int], bool]:
    """Apply the shared step rule to one verified step.

    emitted: the a_true accepted drafts then the residual / bonus token; generated: response length before
    the step. Returns the record, the tokens that enter the response (cut at EOS and at the budget) and
    whether the response ended with EOS.
    """
    eos_at = next((j for j, tok in enumerate(emitted) if tok in eos_token_ids), None)
    budget = max_new_tokens - generated
    remaining = budget if eos_at is None else min(budget, eos_at + 1)
    ended = eos_at is not None and eos_at + 1 <= budget
    accepted = step_accepted(min(a_true, remaining), k, remaining, ended)
    kept = list(emitted[:remaining])
    record = StepRecord(start=generated, accepted=accepted, tokens=len(kept), proposed=proposed,
                        expected=expected)
    return record, kept, ended


def before_eos(drafts: list[int], eos_token_ids: set[int]) -> list[int]:
    """The drafts before the first draft EOS: the ones the step rule can count.

    An accepted draft EOS ends the response and the step rule records it as the step's bonus token, so the
    step accepts min(accepted, j) drafts (j: the EOS's index). Verifying only d_0..d_{j-1} makes the
    kernel's analytic expectation sum exactly those j terms (unclipped it counted the EOS and what follows
    as accepted drafts: biased up). Emitted tokens keep the target's distribution: the token at position
    j is then the bonus sample of p instead of an accept-or-residual test of the EOS, which is p too.
    """
    cut = next((i for i, t in enumerate(drafts) if t in eos_token_ids), None)
    return drafts if cut is None else drafts[:cut]


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def draft_model_of(speculator) -> torch.nn.Module | None:
    """The causal LM to draft with in batch, or None for model-free speculators.

    Accepts a bare model, or a speculator exposing `.draft.model` (calibrate.speculators.draft_model).
    """
    if isinstance(speculator, torch.nn.Module):
        return speculator
    draft = getattr(speculator, "draft", None)
    model = getattr(draft, "model", None)
    return model if isinstance(model, torch.nn.Module) else None


class _SlotCache:
    """A batched KV cache with per-row lengths: right-padded chunks, a slot validity mask, crop on rollback."""

    def __init__(self, model: torch.nn.Module, batch: int, cache: DynamicCache | None = None,
                 lengths: torch.Tensor | None = None):
        self.model = model
        self.device = _model_device(model)
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
    """The KV caches of a batch of prompts, each computed once and padded to the longest: the start of every
    (speculator, k) loop of those requests, which copy their rows of it (`start`).

    `hidden[j]` is request j's hidden-state tuple ((1, n_j, H) each) over its prompt, when it was asked for.
    """

    model: torch.nn.Module
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), (B, heads, slots, dim)
    lengths: torch.Tensor  # (B,) prompt tokens cached per request
    last_logits: torch.Tensor  # (B, V): the logits after each full prompt
    hidden: list[tuple[torch.Tensor, ...] | None]

    def start(self, rows: torch.Tensor) -> _SlotCache:
        """A loop cache for the given requests (a request may appear more than once): a copy of their rows."""
        rows = rows.to(self.lengths.device)
        cache = DynamicCache(ddp_cache_data=((k.index_select(0, rows), v.index_select(0, rows))
                                             for k, v in self.layers)) if self.layers else None
        return _SlotCache(self.model, len(rows), cache=cache, lengths=self.lengths.index_select(0, rows))


@torch.inference_mode()
def prefill(model: torch.nn.Module, prompts: Sequence[Sequence[int]], hidden: bool = False) -> Prefix:
    """Run every prompt through the model once, one at a time (no padding compute), and stack the caches.

    The whole prompt is cached, so every loop begins by sampling its first token from `last_logits` and
    its first draft step feeds that token alone."""
    caches, logits, states = [], [], []
    for prompt in prompts:
        one = _SlotCache(model, 1)
        logits.append(one.feed([list(prompt)], logits_to_keep=1, hidden=hidden)[0, -1])
        caches.append([(layer.keys, layer.values) for layer in one.cache.layers])
        states.append(one.hidden)
    slots = max(len(p) for p in prompts)
    layers = []
    for i in range(len(caches[0])):
        keys, values = zip(*(c[i] for c in caches))
        layers.append((_pad_stack(keys, slots), _pad_stack(values, slots)))
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=_model_device(model))
    return Prefix(model, layers, lengths, torch.stack(logits), states)


def _pad_stack(parts: Sequence[torch.Tensor], slots: int) -> torch.Tensor:
    """(1, heads, n_j, dim) tensors -> one (B, heads, slots, dim) tensor, zero-padded on the right."""
    out = parts[0].new_zeros((len(parts), parts[0].shape[1], slots, parts[0].shape[3]))
    for j, part in enumerate(parts):
        out[j, :, :part.shape[2]] = part[0]
    return out


def _sample_drafts(logits: torch.Tensor, s: _Settings, temperature: float, request_ids: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens (B,) from logits (B, V), and q (B, V) at T > 0 (None at T = 0): softmax(logits / T) warped
    by the sweep's top-k / top-p exactly as the target's p is (`reference.sampling_probs`), so a draft model
    samples as the target does and self-speculation accepts every draft."""
    if temperature <= 0:
        return logits.argmax(dim=-1), None
    q = sampling_probs(logits, temperature, s.top_k, s.top_p)
    keys = rng.stream_key(s.seed, request_ids, positions, rng.DRAFT).to(q.device)
    return rng.exponential_race(q, keys), q


@dataclass(frozen=True)
class _Settings:
    """What every loop of one sweep shares: sampling, verification, budget."""

    temperature: float
    top_p: float | None
    top_k: int | None
    max_new_tokens: int
    eos_token_ids: set[int]
    seed: int
    verify_backend: str
    verification: str

    @property
    def draft_temperature(self) -> float:
        # Target-only verification takes the drafter's greedy tokens and no q (one-hot): draft at temperature 0.
        return 0.0 if self.verification == "target-only" else self.temperature


@dataclass
class _Loop:
    """One (request, k) loop of a speculator: its own response, records and random streams."""

    request: int  # row of the request in the Prefix (its index in the caller's prompt list)
    key: int  # random-stream key of the request (request_keys[index], default index): the same at every k
    loop_id: int  # the id the speculator keeps this loop's state under (distinct per (request, k))
    k: int
    prompt: list[int]
    generator: torch.Generator  # only for model-free speculators that sample their own drafts
    generated: list[int] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated

    def take(self, emitted: Sequence[int], accepted: int, expected: float, proposed: int, s: _Settings,
             is_step: bool = True) -> bool:
        """Record one verified pass; True while the loop goes on."""
        rec, kept, ended = record_step(emitted, accepted, self.k, len(self.generated), s.max_new_tokens,
                                       s.eos_token_ids, expected, proposed=proposed)
        self.records.append(rec if is_step else replace(rec, is_step=False))
        self.generated.extend(kept)
        if ended:
            self.finish_reason = "eos"
        elif len(self.generated) >= s.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is None


def _draft_with_model(dcache: _SlotCache, active: list[_Loop], temperature: float, s: _Settings, ids: torch.Tensor,
                      positions: torch.Tensor, vocab: int) -> tuple[list[list[int]], torch.Tensor | None]:
    """k_r drafts per loop from a draft model with a KV cache: feed what it has not seen, then single tokens.

    Loops of different k share the batch: at depth i only the loops with k_r > i sample (their random
    streams are keyed by request and position, so the company changes nothing) and only those with
    k_r > i + 1 feed their draft (the others get an empty chunk, as if they had stopped). Returns the
    drafts and q (B, max k, V) at T > 0 (None at T = 0: greedy drafts, q = one-hot)."""
    b = len(active)
    ks = [r.k for r in active]
    pending = [r.context[int(n):] for r, n in zip(active, dcache.lengths.tolist())]  # 1 or 2 tokens
    logits = dcache.feed(pending)  # (B, n, Vd)
    last = torch.tensor([len(p) - 1 for p in pending], device=logits.device)
    step_logits = logits[torch.arange(b, device=logits.device), last]  # (B, Vd)
    drafts: list[list[int]] = [[] for _ in active]
    probs = None
    for i in range(max(ks)):
        rows = [j for j in range(b) if ks[j] > i]
        pick = torch.tensor(rows, dtype=torch.int64)
        sub = step_logits if len(rows) == b else step_logits[pick.to(step_logits.device)]
        tok, q = _sample_drafts(sub, s, temperature, ids[pick], positions[pick] + i)
        for j, t in zip(rows, tok.tolist()):
            drafts[j].append(t)
        if q is not None:
            if probs is None:
                probs = q.new_zeros((b, max(ks), q.shape[-1]))
            probs[pick.to(q.device), i] = q
        feeding = [[drafts[j][i]] if ks[j] > i + 1 else [] for j in range(b)]
        if any(feeding):
            step_logits = dcache.feed(feeding)[:, 0]
    if temperature <= 0 or probs is None:
        return drafts, None
    if probs.shape[-1] != vocab:  # a draft vocabulary padded differently from the target's
        probs = torch.nn.functional.pad(probs, (0, max(0, vocab - probs.shape[-1])))[..., :vocab]
    return drafts, probs


def _draft_with_speculator(speculator: Speculator, active: list[_Loop], temperature: float, s: _Settings,
                           vocab: int) -> tuple[list[list[int]], torch.Tensor | None]:
    """Up to k_r drafts per loop from Speculator.draft; q (B, max k, V) when any proposal carries probs
    (one-hot rows for those that do not), else None."""
    drafts, q_list = [], []
    for r in active:
        proposal = speculator.draft(r.loop_id, r.k, temperature, r.generator, top_k=s.top_k, top_p=s.top_p)
        drafts.append([int(t) for t in proposal.tokens[:r.k]])
        q_list.append(proposal.probs)
    if temperature <= 0 or all(q is None for q in q_list):
        return drafts, None
    probs = torch.zeros((len(active), max(r.k for r in active), vocab), dtype=torch.float32)
    for j, (q, d) in enumerate(zip(q_list, drafts)):
        if q is None:
            probs[j, torch.arange(len(d)), torch.tensor(d, dtype=torch.int64)] = 1.0
        else:
            n = min(q.shape[-1], vocab)
            probs[j, :len(d), :n] = q[:len(d), :n].float()
    return drafts, probs


def _verify(logits: torch.Tensor, drafts: list[list[int]], probs: torch.Tensor | None, ids: torch.Tensor,
            positions: torch.Tensor, s: _Settings) -> VerifyOutput:
    """Verify each row's drafts: logits (B, 1 + len(d_j), V) per row, rows padded on the right."""
    device = logits.device
    num_draft = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    rows = _ragged(logits, [len(d) + 1 for d in drafts])
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=device)
    if s.temperature <= 0:
        return verify_greedy(rows, flat, num_draft.to(device), backend=s.verify_backend)
    flat_q = None if probs is None else _ragged(probs, [len(d) for d in drafts]).to(device)
    return verify_rejection(rows, flat, num_draft.to(device), backend=s.verify_backend, draft_probs=flat_q,
                            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                            request_ids=ids.to(device), positions=positions.to(device))


def _ragged(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The first lengths[j] rows of each x[j] ((B, n, V) -> (sum lengths, V)), in order: a view when every
    row is full, as in most steps (a copy of the vocabulary-wide rows costs on the CPU)."""
    if all(n == x.shape[1] for n in lengths):
        return x.reshape(-1, x.shape[-1])
    return torch.cat([x[j, :n] for j, n in enumerate(lengths)])


def first_tokens(prefix: Prefix, keys: Sequence[int], s: _Settings) -> list[int]:
    """Each request's first response token, sampled once from its prompt's logits: the prefill pass emits
    it and verifies no drafts (as serving engines do); its draw is keyed by (request, position 0), so it
    is the same in every (speculator, k) loop of the request."""
    ids = torch.tensor(list(keys), dtype=torch.int64)
    out = _verify(prefix.last_logits.unsqueeze(1), [[] for _ in keys], None, ids, torch.zeros_like(ids), s)
    return out.tokens[:, 0].tolist()


@torch.inference_mode()
def _run_loops(target: Prefix, draft: Prefix | None, speculator: Speculator | None, loops: list[_Loop],
               first: Sequence[int], needs: TargetNeeds, s: _Settings,
               experts: ExpertRecorder | None = None) -> None:
    """Run the given loops (any mix of requests and k) as one batch of speculative decoders until each ends.

    Every loop starts from a copy of its request's prompt cache and its shared first token; a loop's draws
    are keyed by (request, response position), so they do not depend on the loops batched with it."""
    active = [r for r in loops if r.take([first[r.request]], 0, 0.0, 0, s, is_step=False)]
    if not active:
        return
    rows = torch.tensor([r.request for r in active], dtype=torch.int64)
    tcache = target.start(rows)
    dcache = draft.start(rows) if draft is not None else None
    if speculator is not None:
        for r in active:
            hidden = target.hidden[r.request]
            features = select_features(hidden, needs) if needs.any and hidden is not None else None
            n = len(r.prompt)
            speculator.start(r.loop_id, r.prompt, None if features is None else features.rows(0, n - 1))
            speculator.extend(r.loop_id, r.generated, None if features is None else features.rows(n - 1, n))
    vocab = int(target.model.get_output_embeddings().weight.shape[0])  # width of the target's logits
    while active:
        b = len(active)
        ids = torch.tensor([r.key for r in active], dtype=torch.int64)
        positions = torch.tensor([len(r.generated) for r in active], dtype=torch.int64)
        if dcache is not None:
            drafts, probs = _draft_with_model(dcache, active, s.draft_temperature, s, ids, positions, vocab)
        else:
            drafts, probs = _draft_with_speculator(speculator, active, s.draft_temperature, s, vocab)
        proposed = [len(d) for d in drafts]
        drafts = [before_eos(d, s.eos_token_ids) for d in drafts]

        # -- verify: one target pass over [pending token, drafts] ---------------------------------------
        pending = [r.generated[-1] for r in active]  # the cache always holds the context but its last token
        chunks = [[p] + d for p, d in zip(pending, drafts)]
        watch = (experts.verify([r.loop_id for r in active], [len(r.generated) - 1 for r in active], chunks)
                 if experts is not None else contextlib.nullcontext())
        with watch:
            logits = tcache.feed(chunks, hidden=needs.any)  # (B, 1 + max k_r, V)
        out = _verify(logits, drafts, probs, ids, positions, s)
        accepted, tokens = out.num_accepted.tolist(), out.tokens.tolist()
        expected = out.expected_accepted.tolist()

        # -- record, extend responses, roll caches back -----------------------------------------------
        still = []
        for j, r in enumerate(active):
            a = accepted[j]
            before = len(r.generated)
            going = r.take(tokens[j][:a + 1], a, expected[j], proposed[j], s)
            if going:
                still.append(j)
            if speculator is not None and going:  # the target ran pending + the accepted drafts
                new = r.generated[before:]
                speculator.extend(r.loop_id, new, _features(tcache, needs, j, len(new)))
            elif speculator is not None:
                speculator.finish(r.loop_id)
        # Target keeps pending + accepted drafts (the emitted sample is next step's pending token).
        tcache.truncate(tcache.lengths.new_tensor([len(r.context) - 1 for r in active]))
        if dcache is not None:
            # The draft saw pending + d_0..d_{k-2}; it keeps the accepted ones among those.
            fed = [int(n) for n in dcache.lengths.tolist()]
            dcache.truncate(dcache.lengths.new_tensor([min(f, len(r.context) - 1) for f, r in zip(fed, active)]))
        if len(still) < b:
            active = [active[j] for j in still]
            if still:
                sel = torch.tensor(still, dtype=torch.int64)
                tcache.select(sel)
                if dcache is not None:
                    dcache.select(sel)


def _features(tcache: _SlotCache, needs: TargetNeeds, row: int, n: int) -> TargetFeatures | None:
    """The first n positions of batch row `row` of the target's last feed, as the speculator needs them."""
    if not needs.any or tcache.hidden is None:
        return None
    return select_features(tcache.hidden, needs, row).rows(0, n)


def _result(loop: _Loop, segment_labeller: Callable[[list[int]], list[str]] | None) -> StepCounts:
    """A finished loop's records as StepCounts; a step belongs to the segment of its first emitted token."""
    labels = segment_labeller(loop.generated) if segment_labeller is not None else None
    counts = StepCounts(draft_len=loop.k)
    for rec in loop.records:
        segment = labels[rec.start] if labels is not None else "answer"
        if rec.is_step:
            counts.add_step(segment, rec.accepted, rec.tokens, rec.proposed, rec.expected)
        else:
            counts.add_tokens(segment, rec.tokens)
    return counts


def _check(speculators: Sequence[Speculator | torch.nn.Module], prompts: Sequence[Sequence[int]],
           draft_lens: Sequence[int], temperature: float, verification: str,
           request_keys: Sequence[int] | None) -> list[int]:
    """Refuse bad arguments before any forward pass; returns the request keys."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if verification not in VERIFICATION_RULES:
        raise ValueError(f"unknown verification rule {verification!r} (known: {', '.join(VERIFICATION_RULES)})")
    if any(k < 1 for k in draft_lens):
        raise ValueError(f"draft lengths must be >= 1, got {list(draft_lens)}")
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    keys = list(range(len(prompts))) if request_keys is None else [int(x) for x in request_keys]
    if len(keys) != len(prompts) or len(set(keys)) != len(keys) or min(keys, default=0) < 0:
        raise ValueError("request_keys must be distinct non-negative integers, one per prompt")
    for spec in speculators:
        if draft_model_of(spec) is None and not isinstance(spec, Speculator):
            raise TypeError(f"speculator must be a Speculator or a causal LM, got {type(spec).__name__}")
    return keys


def run_sweep(
    target_model: torch.nn.Module,
    speculators: Sequence[Speculator | torch.nn.Module],
    prompts: Sequence[Sequence[int]],
    *,
    draft_lens: Sequence[int],
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int,
    eos_token_ids: set[int],
    seed: int,
    segment_labeller: Callable[[list[int]], list[str]] | None = None,
    verify_backend: str = "auto",
    loop_rows: int = 8,
    request_keys: Sequence[int] | None = None,
    verification: str = "probabilistic",
    experts: ExpertRecorder | None = None,
) -> list[list[SampledResult]]:
    """Every (speculator, k) loop over every prompt, each prompt prefilled once; see the module docstring.

    Returns, per speculator, one SampledResult per prompt. The target prefills each prompt once (with the
    hidden states the speculators need), each draft model once, and the first token is sampled once per
    request; every loop starts from copies. A speculator's loops run `loop_rows` at a time, ordered by
    (k, request), so one batch holds neighbouring draft lengths (rows verify 1 + max k_r positions).
    The counts equal those of each loop run alone, for a fixed seed: draws are keyed by (seed, request key,
    position), never by the batch. With an ExpertRecorder on the target, each result also carries every
    k's ExpertTrace (calibrate.replay.experts): the experts its verify passes touched.
    """
    keys = _check(speculators, prompts, draft_lens, temperature, verification, request_keys)
    if loop_rows < 1:
        raise ValueError(f"loop_rows must be >= 1, got {loop_rows}")
    s = _Settings(temperature, top_p, top_k, max_new_tokens, set(eos_token_ids), seed, verify_backend, verification)
    free = [spec for spec in speculators if draft_model_of(spec) is None]
    needs = TargetNeeds(layers=tuple(sorted({i for spec in free for i in spec.needs.layers})),
                        last=any(spec.needs.last for spec in free))
    prefixes = {id(target_model): prefill(target_model, prompts, hidden=needs.any)}
    first = first_tokens(prefixes[id(target_model)], keys, s)
    out = []
    for spec in speculators:
        model = draft_model_of(spec)
        if model is not None and id(model) not in prefixes:
            prefixes[id(model)] = prefill(model, prompts)
        draft = prefixes[id(model)] if model is not None else None
        loops = _plan(prompts, keys, draft_lens, seed)
        for start in range(0, len(loops), loop_rows):
            _run_loops(prefixes[id(target_model)], draft, spec if model is None else None,
                       loops[start:start + loop_rows], first, needs, s, experts)
        results = [SampledResult() for _ in prompts]
        for loop in loops:
            res = results[loop.request]
            res.counts[loop.k] = _result(loop, segment_labeller)
            res.tokens[loop.k] = loop.generated
            res.finish_reason[loop.k] = loop.finish_reason or "length"
            if experts is not None:
                res.experts[loop.k] = experts.trace(loop.loop_id, loop.generated)
        out.append(results)
    return out


def _plan(prompts: Sequence[Sequence[int]], keys: Sequence[int], draft_lens: Sequence[int], seed: int) -> list[_Loop]:
    """The loops of one speculator, ordered by (k, request). A model-free speculator that samples its own
    drafts (EAGLE-3 at T > 0) gets a torch generator per loop, seeded by (seed, request key, k), so its
    draws too are the loop's own whatever the batch (one generator per k, consumed by whichever requests
    shared the batch, made them depend on the batch size)."""
    loops = []
    for k in dict.fromkeys(draft_lens):
        for i, p in enumerate(prompts):
            generator = torch.Generator().manual_seed(((seed * 1000003 + k) * 1000033 + keys[i]) % (1 << 63))
            loops.append(_Loop(request=i, key=keys[i], loop_id=len(loops), k=k, prompt=list(p), generator=generator))
    return loops


def run_sampled(
    target_model: torch.nn.Module,
    speculator: Speculator | torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    draft_lens: Sequence[int],
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int,
    eos_token_ids: set[int],
    seed: int,
    segment_labeller: Callable[[list[int]], list[str]] | None = None,
    verify_backend: str = "auto",
    batch_size: int = 8,
    request_keys: Sequence[int] | None = None,
    verification: str = "probabilistic",
) -> list[SampledResult]:
    """The loops of one speculator at every k over all prompts: run_sweep with one speculator, `batch_size`
    loops ((request, k) pairs) per batch.

    `verification` is one of VERIFICATION_RULES (it matters only at temperature > 0, and only for drafters
    that have a q: a deterministic drafter's q is one-hot under both rules).

    Returns one SampledResult per prompt, in order. `segment_labeller(tokens)` labels each generated
    token (thinking / answer / tool_call); a step belongs to the segment of its first emitted token;
    without it everything is "answer". `request_keys` (default: the index in `prompts`) key each request's
    random streams; callers that split one sweep over several calls pass globally distinct, stable keys
    (e.g. the request's index in the whole dataset), or requests of different calls would share draws.
    """
    return run_sweep(target_model, [speculator], prompts, draft_lens=draft_lens, temperature=temperature,
                     top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                     seed=seed, segment_labeller=segment_labeller, verify_backend=verify_backend,
                     loop_rows=batch_size, request_keys=request_keys, verification=verification)[0]
