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

Entry point (what the runner calls, with already-tokenised prompts):

    results = run_sampled(target_model, speculator, prompts, draft_lens=[1, 3, 5], temperature=0.7,
                          top_p=0.95, top_k=None, max_new_tokens=1024, eos_token_ids={eos}, seed=0,
                          segment_labeller=labeller, verify_backend="auto", batch_size=8)
    results[i].counts[k]         -> StepCounts of request i at draft length k
    results[i].tokens[k]         -> the token ids that run generated (EOS included when it ended)
    results[i].finish_reason[k]  -> "eos" | "length"

Each k is its own loop run (at temperature > 0 the responses differ per k). `speculator` is
- a draft model: the lead's DraftModelSpeculator (its `.draft.model` is used) or a bare transformers causal
  LM (e.g. the target itself, for self-speculation); it drafts in batch with its own KV cache, sampling
  from softmax(logits / T) (no top-k / top-p: any q is exact, this one is what vLLM's drafters use), and
  hands q to the verifier; at temperature 0 it drafts its argmax;
- any other Speculator (n-gram, suffix, EAGLE-3, ...): per request id (its request key) `start` after the
  prefill, `draft(request_id, k, temperature, generator)` per step, `extend` with each verified block and
  `finish`; when it declares `needs`, the target's hidden states of the positions each pass verified come
  with `start` / `extend` (calibrate.speculators.base). Its `probs` are used when given, else q = one-hot.
  Proposals may be shorter than k.

Randomness is counter-based (calibrate.kernels.rng), keyed by (seed, request key (`request_keys`, default
the index in `prompts`), position in the response, purpose) for both the draft samples and the
verification, so a request's outcome does not depend on the batch it ran in or on the backend.

KV caches (`_SlotCache`): one transformers DynamicCache per model, right-padded chunks, a validity mask per
slot and explicit position ids. Rolling back = marking a request's slots beyond its kept length invalid,
then cropping the cache to the longest kept request. Slots rejected by some requests while others kept
theirs remain as masked holes (attention ignores them; they cost memory and attention time, no accuracy).
Finished requests leave the batch (DynamicCache.batch_select_indices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from calibrate.kernels import rng, verify_greedy, verify_rejection
from calibrate.kernels.reference import VerifyOutput
from calibrate.replay.counts import StepCounts
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
    """A batched KV cache with per-request lengths: right-padded chunks, a slot validity mask, crop on rollback."""

    def __init__(self, model: torch.nn.Module, batch: int):
        self.model = model
        self.device = _model_device(model)
        self.cache = DynamicCache()
        self.valid = torch.zeros((batch, 0), dtype=torch.bool, device=self.device)  # (B, slots)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=self.device)  # valid tokens per request
        self.hidden: tuple[torch.Tensor, ...] | None = None  # hidden states of the last feed, when asked

    @torch.inference_mode()
    def feed(self, chunks: Sequence[Sequence[int]], logits_to_keep: int = 0, hidden: bool = False) -> torch.Tensor:
        """Append one chunk of tokens per request (may be empty); returns logits (B, n, V) (n = widest chunk).

        With logits_to_keep=1 only the last column's logits are computed (prefill). With hidden=True the
        feed's hidden states (transformers' tuple, (B, n, H) each) are kept in `self.hidden`."""
        b = len(chunks)
        width = max(len(c) for c in chunks)
        ids = torch.zeros((b, width), dtype=torch.int64)
        new_valid = torch.zeros((b, width), dtype=torch.bool)
        for r, chunk in enumerate(chunks):
            ids[r, :len(chunk)] = torch.tensor(list(chunk), dtype=torch.int64)
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
        """Keep the first keep[r] valid tokens of each request; crop the slots nobody needs any more."""
        keep = keep.to(self.device)
        self.valid &= torch.cumsum(self.valid.long(), dim=1) <= keep.unsqueeze(1)
        self.lengths = torch.minimum(self.lengths, keep)
        used = torch.nonzero(self.valid.any(0))
        slots = int(used.max()) + 1 if used.numel() else 0
        if slots < self.valid.shape[1]:
            self.cache.crop(slots - self.valid.shape[1])  # transformers 5: a negative count removes slots
            self.valid = self.valid[:, :slots]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (finished requests leave)."""
        rows = rows.to(self.device)
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self.lengths = self.lengths[rows]


def _sample_drafts(logits: torch.Tensor, temperature: float, seed: int, request_ids: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens (B,) from logits (B, V), and q = softmax(logits / T) (B, V) at T > 0 (None at T = 0)."""
    if temperature <= 0:
        return logits.argmax(dim=-1), None
    q = torch.softmax(logits.float() / temperature, dim=-1)
    keys = rng.stream_key(seed, request_ids, positions, rng.DRAFT).to(q.device)
    return rng.exponential_race(q, keys), q


@dataclass
class _Request:
    index: int  # position in the caller's prompt list
    key: int  # random-stream key of the request (request_keys[index], default index)
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated


def _draft_with_model(dcache: _SlotCache, active: list[_Request], k: int, temperature: float, seed: int,
                      ids: torch.Tensor, positions: torch.Tensor,
                      vocab: int) -> tuple[list[list[int]], torch.Tensor | None]:
    """k drafts per request from a draft model with a KV cache: feed what it has not seen, then k - 1 single
    tokens. Returns the drafts and q (B, k, V) at T > 0 (None at T = 0: greedy drafts, q = one-hot)."""
    b = len(active)
    pending = [r.context[int(n):] for r, n in zip(active, dcache.lengths.tolist())]  # 1 or 2 tokens
    logits = dcache.feed(pending)  # (B, n, Vd)
    last = torch.tensor([len(p) - 1 for p in pending], device=logits.device)
    step_logits = logits[torch.arange(b, device=logits.device), last]  # (B, Vd)
    cols, qs = [], []
    for i in range(k):
        tok, q = _sample_drafts(step_logits, temperature, seed, ids, positions + i)
        cols.append(tok)
        qs.append(q)
        if i < k - 1:
            step_logits = dcache.feed([[t] for t in tok.tolist()])[:, 0]
    drafts = torch.stack(cols, dim=1).tolist()  # (B, k)
    if temperature <= 0:
        return drafts, None
    probs = torch.stack(qs, dim=1)  # (B, k, Vd)
    if probs.shape[-1] != vocab:  # a draft vocabulary padded differently from the target's
        probs = torch.nn.functional.pad(probs, (0, max(0, vocab - probs.shape[-1])))[..., :vocab]
    return drafts, probs


def _draft_with_speculator(speculator: Speculator, active: list[_Request], k: int, temperature: float,
                           generator: torch.Generator, vocab: int) -> tuple[list[list[int]], torch.Tensor | None]:
    """Up to k drafts per request from Speculator.propose; q (B, k, V) when any proposal carries probs
    (one-hot rows for those that do not), else None."""
    drafts, q_list = [], []
    for r in active:
        proposal = speculator.draft(r.key, k, temperature, generator)
        drafts.append([int(t) for t in proposal.tokens[:k]])
        q_list.append(proposal.probs)
    if temperature <= 0 or all(q is None for q in q_list):
        return drafts, None
    probs = torch.zeros((len(active), k, vocab), dtype=torch.float32)
    for j, (q, d) in enumerate(zip(q_list, drafts)):
        if q is None:
            probs[j, torch.arange(len(d)), torch.tensor(d, dtype=torch.int64)] = 1.0
        else:
            n = min(q.shape[-1], vocab)
            probs[j, :len(d), :n] = q[:len(d), :n].float()
    return drafts, probs


@torch.inference_mode()
def _run_batch(target: torch.nn.Module, speculator, draft_model: torch.nn.Module | None,
               requests: list[_Request], k: int, temperature: float, top_p: float | None, top_k: int | None,
               max_new_tokens: int, eos_token_ids: set[int], seed: int, verify_backend: str,
               generator: torch.Generator, verification: str = "probabilistic") -> None:
    """Run speculative decoding for one batch of requests at draft length k until each one finishes."""
    # Target-only verification takes the drafter's greedy tokens and no q (one-hot): draft at temperature 0.
    draft_temperature = 0.0 if verification == "target-only" else temperature
    tcache = _SlotCache(target, len(requests))
    dcache = _SlotCache(draft_model, len(requests)) if draft_model is not None else None
    needs = speculator.needs if dcache is None else TargetNeeds()
    # Prefill everything but the last prompt token: the loop invariant is "cache = context[:-pending]".
    if any(len(r.prompt) > 1 for r in requests):
        tcache.feed([r.prompt[:-1] for r in requests], logits_to_keep=1, hidden=needs.any)
        if dcache is not None:
            dcache.feed([r.prompt[:-1] for r in requests], logits_to_keep=1)
    if dcache is None:
        for j, r in enumerate(requests):
            speculator.start(r.key, r.prompt, _features(tcache, needs, j, len(r.prompt) - 1))
    active = list(requests)
    vocab = int(target.get_output_embeddings().weight.shape[0])  # width of the target's logits
    device = tcache.device
    prefill = True  # the first pass emits the first token and verifies no drafts, as serving engines do
    while active:
        b = len(active)
        ids = torch.tensor([r.key for r in active], dtype=torch.int64)
        positions = torch.tensor([len(r.generated) for r in active], dtype=torch.int64)

        # -- draft ------------------------------------------------------------------------------------
        if prefill:
            drafts, probs = [[] for _ in active], None
        elif dcache is not None:
            drafts, probs = _draft_with_model(dcache, active, k, draft_temperature, seed, ids, positions, vocab)
        else:
            drafts, probs = _draft_with_speculator(speculator, active, k, draft_temperature, generator, vocab)
        proposed = [len(d) for d in drafts]
        drafts = [before_eos(d, eos_token_ids) for d in drafts]

        # -- verify: one target pass over [pending token, drafts] -----------------------------------------
        pending = [r.context[int(n):] for r, n in zip(active, tcache.lengths.tolist())]  # always 1 token
        logits = tcache.feed([p + d for p, d in zip(pending, drafts)], hidden=needs.any)  # (B, 1 + max k_r, V)
        num_draft = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
        rows = torch.cat([logits[j, len(pending[j]) - 1: len(pending[j]) + len(d)] for j, d in enumerate(drafts)])
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=device)
        if temperature <= 0:
            out: VerifyOutput = verify_greedy(rows, flat, num_draft.to(device), backend=verify_backend)
        else:
            flat_q = None
            if probs is not None:
                flat_q = torch.cat([probs[j, :len(d)] for j, d in enumerate(drafts)]).to(device)
            out = verify_rejection(rows, flat, num_draft.to(device), backend=verify_backend,
                                   draft_probs=flat_q, temperature=temperature, top_k=top_k, top_p=top_p,
                                   seed=seed, request_ids=ids.to(device), positions=positions.to(device))
        accepted = out.num_accepted.tolist()
        tokens = out.tokens.tolist()
        expected = out.expected_accepted.tolist()

        # -- record, extend responses, roll caches back -----------------------------------------------
        still = []
        for j, r in enumerate(active):
            a = accepted[j]
            rec, kept, ended = record_step(tokens[j][:a + 1], a, k, len(r.generated), max_new_tokens,
                                           eos_token_ids, expected[j], proposed=proposed[j])
            r.records.append(replace(rec, is_step=False) if prefill else rec)
            r.generated.extend(kept)
            if ended:
                r.finish_reason = "eos"
            elif len(r.generated) >= max_new_tokens:
                r.finish_reason = "length"
            else:
                still.append(j)
            if dcache is None and r.finish_reason is None:  # the target ran pending + the accepted drafts
                speculator.extend(r.key, kept, _features(tcache, needs, j, len(kept)))
            elif dcache is None:
                speculator.finish(r.key)
        # Target keeps pending + accepted drafts (the emitted sample is next step's pending token).
        tcache.truncate(tcache.lengths.new_tensor([len(r.context) - 1 for r in active]))
        if dcache is not None:
            # The draft saw pending + d_0..d_{k-2}; it keeps the accepted ones among those.
            fed = [int(n) for n in dcache.lengths.tolist()]
            keep = [min(f, len(r.context) - 1) for f, r in zip(fed, active)]
            dcache.truncate(dcache.lengths.new_tensor(keep))
        prefill = False
        if len(still) < b:
            sel = torch.tensor(still, dtype=torch.int64)
            if still:
                tcache.select(sel)
                if dcache is not None:
                    dcache.select(sel)
            active = [active[j] for j in still]


def _features(tcache: _SlotCache, needs: TargetNeeds, row: int, n: int) -> TargetFeatures | None:
    """The first n positions of batch row `row` of the target's last feed, as the speculator needs them."""
    if not needs.any:
        return None
    if tcache.hidden is None:  # a one-token prompt: nothing was prefilled
        return None
    return select_features(tcache.hidden, needs, row).rows(0, n)


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
    """Run the speculative-decoding loop once per k over all prompts; see the module docstring.

    `verification` is one of VERIFICATION_RULES (it matters only at temperature > 0, and only for drafters
    that have a q: a deterministic drafter's q is one-hot under both rules).

    Returns one SampledResult per prompt, in order. `segment_labeller(tokens)` labels each generated
    token (thinking / answer / tool_call); a step belongs to the segment of its first emitted token;
    without it everything is "answer". `request_keys` (default: the index in `prompts`) key each request's
    random streams; callers that split one sweep over several calls pass globally distinct, stable keys
    (e.g. the request's index in the whole dataset), or requests of different calls would share draws.
    """
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
    draft_model = draft_model_of(speculator)
    if draft_model is None and not isinstance(speculator, Speculator):
        raise TypeError(f"speculator must be a Speculator or a causal LM, got {type(speculator).__name__}")
    results = [SampledResult() for _ in prompts]
    for k in draft_lens:
        generator = torch.Generator().manual_seed(seed * 1000003 + k)  # only for model-free speculators' propose
        for start in range(0, len(prompts), batch_size):
            batch = [_Request(index=i, key=keys[i], prompt=list(prompts[i]))
                     for i in range(start, min(start + batch_size, len(prompts)))]
            _run_batch(target_model, speculator, draft_model, batch, k, temperature, top_p, top_k,
                       max_new_tokens, eos_token_ids, seed, verify_backend, generator, verification)
            for r in batch:
                labels = segment_labeller(r.generated) if segment_labeller is not None else None
                counts = StepCounts(draft_len=k)
                for rec in r.records:
                    segment = labels[rec.start] if labels is not None else "answer"
                    if rec.is_step:
                        counts.add_step(segment, rec.accepted, rec.tokens, rec.proposed, rec.expected)
                    else:
                        counts.add_tokens(segment, rec.tokens)
                res = results[r.index]
                res.counts[k] = counts
                res.tokens[k] = r.generated
                res.finish_reason[k] = r.finish_reason or "length"
    return results
