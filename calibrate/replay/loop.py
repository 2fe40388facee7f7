"""The speculative-decoding loop: draft -> verify -> accept -> roll back, batched, at any temperature.

At temperature > 0 there is no replay shortcut: the target's response depends on the random draws, so the
loop really decodes: draft k tokens, verify the k + 1 positions in ONE target forward pass, accept by
rejection sampling (calibrate.kernels), roll both KV caches back past the rejected tokens, repeat. At
temperature 0 it is a plain greedy speculative decoder (engine "loop"). The first pass only prefills and
emits the first token (no drafts), as serving engines do. Its output is exactly target-distributed, and
each step's accepted count is recorded with the shared step rule (calibrate.replay.steps.step_accepted), so
the histograms mean what the greedy replay-once engine's mean. It also records the analytic expected
acceptance of each step (running product of min(1, p/q), computed by the verification kernel): same mean
as the realised counts, lower variance.

    results = run_loops(target_model, [spec_a, spec_b], prompts, LoopSettings(Sampling(0.7, 0.95), 1024, {eos}),
                        LoopLayout(ks=[1, 3, 5], loop_rows=8), LoopWatch(labeller=labeller))
    results[s][i].counts[k]         -> StepCounts of request i at k under speculator s
    results[s][i].tokens[k]         -> the token ids that loop generated (EOS included when it ended)
    results[s][i].finish_reason[k]  -> "eos" | "length"

Each (speculator, k, request) is its own loop (at temperature > 0 the responses differ per k), but a run
pays for each prompt once: the target and each draft model prefill it once (calibrate.kv_slots.prefill),
its first token is drawn once, and every loop starts from a copy of its row. A speculator's loops run
`loop_rows` at a time as one batch, ordered by (k, request), so loops of one request at neighbouring k share
a batch: each row drafts its own k and verifies 1 + k positions. For each batch the loop asks the speculator
for its side of it (`Speculator.loop_drafts`, one protocol for every kind: calibrate.speculators.base.
LoopDrafts), which drafts for the batch each step and sees what the target verified, with the target's
hidden states of the positions each pass verified where it declares `needs`. Its q is used when given,
else q = one-hot. Proposals may be shorter than k. The loop names no kind: a draft model drafts the batch
at once with its own KV cache (calibrate.speculators.draft_model), the others per loop
(calibrate.speculators.per_loop).

Randomness is counter-based (calibrate.kernels.rng), keyed by (seed, request key (`request_keys`, default
the index in `prompts`), position in the response, purpose) for the draft samples and the verification, so
a loop's outcome does not depend on the loops batched with it, on the prefill being shared, or on the
verify kernel. A speculator that samples with a torch generator gets one per loop, seeded by (seed,
request key, k).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from calibrate.kernels import verify_greedy, verify_rejection
from calibrate.terms import Sampling, StepCounts, check_k
from calibrate.kernels.reference import VerifyOutput
from calibrate.kv_slots import Prefill, Prefix, SlotCache, prefill
from calibrate.progress import TokenProgress
from calibrate.replay.experts import ExpertRecorder, ExpertTrace
from calibrate.seeds import loop_seed
from calibrate.replay.steps import step_accepted
from calibrate.speculators.base import DraftBatch, LoopDrafts, Speculator
from calibrate.target_features import TargetNeeds

# Verification rules at temperature > 0. Both emit exactly target-distributed tokens; they differ in AL.
# - "target-only" (the default: the rule of the engines the exports feed): greedy (argmax) drafts, accepted
#   with probability p_target(draft), i.e. q one-hot, residual p without the draft: vLLM v1's model runner
#   (draft_probs None), SGLang's EAGLE (tree_speculative_sampling_target_only), and llama.cpp (a draft is
#   accepted when the sampled token equals it). Verified coupled (calibrate.kernels.reference): a draft is
#   accepted iff it is the target's keyed sample there, so the responses are plain keyed sampling and
#   replay-once scores them in one pass. Its expected acceptance is the running product of p(d_i).
# - "probabilistic": drafts sampled from the drafter's q, accepted with min(1, p/q), residual max(p - q, 0)
#   (Leviathan et al. 2023; transformers' assisted generation): the loop only, since a step's outcome then
#   depends on the drafter's own draws, not on the response alone.
VERIFICATION_RULES = ("target-only", "probabilistic")


@dataclass(frozen=True)
class LoopSettings:
    """What every loop of one run shares: sampling, budget, verification."""

    sampling: Sampling
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    verify_kernel: str = "auto"  # calibrate.kernels.KERNELS
    verification: str = "target-only"  # one of VERIFICATION_RULES

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))  # any set of ids will do

    @property
    def draft_temperature(self) -> float:
        # Target-only verification takes the drafter's greedy tokens and no q (one-hot): draft at temperature 0.
        return 0.0 if self.verification == "target-only" else self.sampling.temperature


@dataclass
class LoopResult:
    """One request's outcome under one speculator, per k (each k is its own generation at temperature > 0)."""

    counts: dict[int, StepCounts] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish_reason: dict[int, str] = field(default_factory=dict)  # "eos" | "length"
    experts: dict[int, ExpertTrace] = field(default_factory=dict)  # when run_loops was given an ExpertRecorder


@dataclass
class StepRecord:
    """One step of one loop, as the step rule saw it."""

    start: int  # response position of the step's first emitted token
    accepted: int | None  # step_accepted(...); None when censored by max_new_tokens
    tokens: int  # tokens this step added to the response
    proposed: int  # drafts the speculator proposed
    expected: float  # analytic E[accepted drafts | proposed drafts]
    is_step: bool = True  # False for the prefill pass's first token (calibrate.replay.steps)


def record_step(emitted: Sequence[int], a_true: int, k: int, generated: int, max_new_tokens: int,
                eos_token_ids: frozenset[int], expected: float, proposed: int) -> tuple[StepRecord, list[int], bool]:
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


def before_eos(drafts: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """The drafts before the first draft EOS: the ones the step rule can count.

    An accepted draft EOS ends the response and the step rule records it as the step's bonus token, so the
    step accepts min(accepted, j) drafts (j: the EOS's index). Verifying only d_0..d_{j-1} makes the
    kernel's analytic expectation sum exactly those j terms (unclipped it counted the EOS and what follows
    as accepted drafts: biased up). Emitted tokens keep the target's distribution: the token at position
    j is then the bonus sample of p instead of an accept-or-residual test of the EOS, which is p too.
    """
    cut = next((i for i, t in enumerate(drafts) if t in eos_token_ids), None)
    return drafts if cut is None else drafts[:cut]


@dataclass
class Loop:
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

    @property
    def last_step_tokens(self) -> list[int]:
        """The tokens the last verified pass added to the response."""
        n = self.records[-1].tokens
        return self.generated[len(self.generated) - n:] if n else []

    def take(self, emitted: Sequence[int], accepted: int, expected: float, proposed: int, s: LoopSettings,
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


# -- the step ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def decode(target: Prefix, drafter: LoopDrafts, loops: list[Loop], first: Sequence[int],
           s: LoopSettings, experts: ExpertRecorder | None = None, progress: TokenProgress | None = None) -> None:
    """Run the loops (any mix of requests and k) as one batch of speculative decoders until each ends.

    Every loop starts from a copy of its request's prompt cache and the request's first token. `progress`
    is told of the tokens each step adds to the responses."""
    active = [r for r in loops if r.take([first[r.request]], 0, 0.0, 0, s, is_step=False)]
    _report(progress, loops)
    if not active:
        return
    rows = torch.tensor([r.request for r in active], dtype=torch.int64)
    cache = target.start(rows)
    drafter.begin(active, rows)
    while active:
        keys = torch.tensor([r.key for r in active], dtype=torch.int64)
        positions = torch.tensor([len(r.generated) for r in active], dtype=torch.int64)
        # draft: up to k_r tokens per loop (and q where the drafter has one)
        drafts, q = drafter.draft(active, keys, positions)
        proposed = [len(d) for d in drafts]
        drafts = [before_eos(d, s.eos_token_ids) for d in drafts]
        # verify: one target pass over [pending token, drafts]; the cache holds the context but its last token
        chunks = [[r.generated[-1], *d] for r, d in zip(active, drafts)]
        with _watch(experts, active, chunks):
            logits = cache.feed(chunks, hidden=drafter.needs.any)  # (B, 1 + max k_r, V)
        out = verify(logits, drafts, q, keys, positions, s)
        # accept: each loop takes its accepted drafts and the residual / bonus token
        going = [r.take(emitted[:a + 1], a, e, n, s) for r, emitted, a, e, n in
                 zip(active, out.tokens.tolist(), out.num_accepted.tolist(), out.expected_accepted.tolist(), proposed)]
        _report(progress, active)
        # roll back: the target keeps pending + accepted drafts (the emitted token is next step's pending)
        drafter.verified(active, going, cache)
        cache.truncate(cache.lengths.new_tensor([len(r.context) - 1 for r in active]))
        if not all(going):
            still = [j for j, g in enumerate(going) if g]
            active = [active[j] for j in still]
            if still:
                cache.select(torch.tensor(still, dtype=torch.int64))
                drafter.select(still)


def _report(progress: TokenProgress | None, loops: Sequence[Loop]) -> None:
    """The tokens the last pass added to these loops' responses, to whoever watches the run."""
    if progress is not None:
        progress(sum(r.records[-1].tokens for r in loops if r.records))


def _watch(experts: ExpertRecorder | None, active: Sequence[Loop], chunks: list[list[int]]):
    """The MoE verify-cost recorder armed around one verify pass, when the run profiles experts."""
    if experts is None:
        return contextlib.nullcontext()
    return experts.verify([r.loop_id for r in active], [len(r.generated) - 1 for r in active], chunks)


def verify(logits: torch.Tensor, drafts: list[list[int]], probs: torch.Tensor | None, keys: torch.Tensor,
           positions: torch.Tensor, s: LoopSettings) -> VerifyOutput:
    """Verify each row's drafts: logits (B, 1 + len(d_j), V) per row, rows padded on the right."""
    device = logits.device
    drafted = torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=device)
    rows = _ragged(logits, [len(d) + 1 for d in drafts])
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=device)
    if s.sampling.temperature <= 0:
        return verify_greedy(rows, flat, drafted, kernel=s.verify_kernel)
    flat_q = None if probs is None else _ragged(probs, [len(d) for d in drafts]).to(device)
    return verify_rejection(rows, flat, drafted, kernel=s.verify_kernel, draft_probs=flat_q,
                            temperature=s.sampling.temperature, top_k=s.sampling.top_k, top_p=s.sampling.top_p,
                            seed=s.sampling.seed, request_ids=keys.to(device), positions=positions.to(device))


def _ragged(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The first lengths[j] rows of each x[j] ((B, n, V) -> (sum lengths, V)), in order: a view when every
    row is full, as in most steps (a copy of the vocabulary-wide rows costs on the CPU)."""
    if all(n == x.shape[1] for n in lengths):
        return x.reshape(-1, x.shape[-1])
    return torch.cat([x[j, :n] for j, n in enumerate(lengths)])


def first_tokens(prefix: Prefix, keys: Sequence[int], s: LoopSettings) -> list[int]:
    """Each request's first response token, sampled once from its prompt's logits: the prefill pass emits
    it and verifies no drafts (as serving engines do); its draw is keyed by (request, position 0), so it
    is the same in every (speculator, k) loop of the request."""
    ids = torch.tensor(list(keys), dtype=torch.int64)
    out = verify(prefix.last_logits.unsqueeze(1), [[] for _ in keys], None, ids, torch.zeros_like(ids), s)
    return out.tokens[:, 0].tolist()


# -- no speculation ----------------------------------------------------------------------------------------

class PlainDrafts:
    """No speculation: each pass verifies its pending token alone (plain decoding), so a loop's response is
    the target's own: greedy, or at T > 0 each position's keyed sample (the draw the coupled verification
    makes there, as replay's keyed sampling does). Replay generates from cached prompts with it
    (`plain_decode`)."""

    needs = TargetNeeds()

    def begin(self, active: Sequence[Loop], rows: torch.Tensor) -> None:
        pass

    def draft(self, active: Sequence[Loop], keys: torch.Tensor,
              positions: torch.Tensor) -> tuple[list[list[int]], torch.Tensor | None]:
        return [[] for _ in active], None

    def verified(self, active: Sequence[Loop], going: Sequence[bool], target_cache: SlotCache) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass


def plain_decode(target: Prefix, prompts: Sequence[Sequence[int]], keys: Sequence[int], s: LoopSettings,
                 progress: TokenProgress | None = None) -> list[Loop]:
    """Every request's response by plain decoding from its cached prompt (the Prefix's rows are copied, so
    the response is a branch its prompt's cache never sees): greedy, or the keyed samples of `keys`."""
    first = first_tokens(target, keys, s)
    loops = [Loop(request=i, key=int(key), loop_id=i, k=1, prompt=list(p), generator=torch.Generator())
             for i, (p, key) in enumerate(zip(prompts, keys, strict=True))]
    decode(target, PlainDrafts(), loops, first, s, progress=progress)
    return loops


# -- the entry point ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoopLayout:
    """How a run lays out its loops: the k values (one loop per (request, k)), the loops per batch, each
    request's random-stream key, and how the prompts' caches are made.

    `request_keys` (default: the index in the prompts) key each request's random streams; callers that split
    one run over several calls pass globally distinct, stable keys (the runner: a hash of the request id),
    or requests of different calls would share draws. `prefill_with` makes the prompts' caches in the
    target and in each draft model (default `prefill`; a batch of whole-trajectory turns: its
    conversations' caches, calibrate.kv_slots.ConversationCaches)."""

    ks: Sequence[int]
    loop_rows: int = 8
    request_keys: Sequence[int] | None = None
    prefill_with: Prefill = prefill


@dataclass(frozen=True)
class LoopWatch:
    """What a run records besides the counts, and who watches it go.

    `labeller(tokens)` labels each generated token (thinking / answer / tool_call); a step belongs to the
    segment of its first emitted token; without it everything is "answer". With an ExpertRecorder on the
    target, each result also carries every k's ExpertTrace (calibrate.replay.experts): the experts its
    verify passes touched. `progress` is told of the tokens each step adds."""

    labeller: Callable[[list[int]], list[str]] | None = None
    experts: ExpertRecorder | None = None
    progress: TokenProgress | None = None


def run_loops(target_model: torch.nn.Module, speculators: Sequence[Speculator], prompts: Sequence[Sequence[int]],
              settings: LoopSettings, layout: LoopLayout, watch: LoopWatch = LoopWatch()) -> list[list[LoopResult]]:
    """Every (speculator, k) loop over every prompt, each prompt prefilled once; see the module docstring.

    Returns, per speculator, one LoopResult per prompt. The counts equal those of each loop run alone, for
    a fixed seed.
    """
    s, ks, loop_rows = settings, layout.ks, layout.loop_rows
    keys = _check(speculators, prompts, s, layout)
    needs = TargetNeeds(layers=tuple(sorted({i for spec in speculators for i in spec.needs.layers})),
                        last=any(spec.needs.last for spec in speculators))
    target = layout.prefill_with(target_model, prompts, needs if needs.any else None)
    first = first_tokens(target, keys, s)
    vocab = int(target_model.get_output_embeddings().weight.shape[0])  # width of the target's logits
    made = {id(target_model): target}  # a draft model prefills once, whatever number of its speculators

    def prefixes(model: torch.nn.Module) -> Prefix:
        if id(model) not in made:
            made[id(model)] = layout.prefill_with(model, prompts, None)
        return made[id(model)]

    batch = DraftBatch(target, s.sampling, s.draft_temperature, vocab, prefixes)
    out = []
    for spec in speculators:
        loops = _plan(prompts, keys, ks, s.sampling.seed)
        for start in range(0, len(loops), loop_rows):
            decode(target, spec.loop_drafts(batch), loops[start:start + loop_rows], first, s, watch.experts,
                   watch.progress)
        out.append(_results(loops, len(prompts), watch.labeller, watch.experts))
    return out


def _results(loops: Sequence[Loop], requests: int, labeller: Callable[[list[int]], list[str]] | None,
             experts: ExpertRecorder | None) -> list[LoopResult]:
    results = [LoopResult() for _ in range(requests)]
    for loop in loops:
        res = results[loop.request]
        res.counts[loop.k] = _counts(loop, labeller)
        res.tokens[loop.k] = loop.generated
        res.finish_reason[loop.k] = loop.finish_reason or "length"
        if experts is not None:
            res.experts[loop.k] = experts.trace(loop.loop_id, loop.generated)
    return results


def _counts(loop: Loop, labeller: Callable[[list[int]], list[str]] | None) -> StepCounts:
    """A finished loop's records as StepCounts; a step belongs to the segment of its first emitted token."""
    labels = labeller(loop.generated) if labeller is not None else None
    counts = StepCounts(k=loop.k)
    for rec in loop.records:
        segment = labels[rec.start] if labels is not None else "answer"
        if rec.is_step:
            counts.add_step(segment, rec.accepted, rec.tokens, rec.proposed, rec.expected, position=rec.start)
        else:
            counts.add_tokens(segment, rec.tokens)
    return counts


def _check(speculators: Sequence[Speculator], prompts: Sequence[Sequence[int]], s: LoopSettings,
           layout: LoopLayout) -> list[int]:
    """Refuse bad arguments before any forward pass; returns the request keys."""
    if s.sampling.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {s.sampling.temperature}")
    if s.verification not in VERIFICATION_RULES:
        raise ValueError(f"unknown verification rule {s.verification!r} (known: {', '.join(VERIFICATION_RULES)})")
    check_k(layout.ks)
    if layout.loop_rows < 1:
        raise ValueError(f"loop_rows must be >= 1, got {layout.loop_rows}")
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    request_keys = layout.request_keys
    keys = list(range(len(prompts))) if request_keys is None else [int(x) for x in request_keys]
    if len(keys) != len(prompts) or len(set(keys)) != len(keys) or min(keys, default=0) < 0:
        raise ValueError("request_keys must be distinct non-negative integers, one per prompt")
    for spec in speculators:
        if not isinstance(spec, Speculator):
            raise TypeError(f"speculator must be a Speculator (a bare model drafts as a draft model's), "
                            f"got {type(spec).__name__}")
    return keys


def _plan(prompts: Sequence[Sequence[int]], keys: Sequence[int], ks: Sequence[int], seed: int) -> list[Loop]:
    """The loops of one speculator, ordered by (k, request). A model-free speculator that samples its own
    drafts (EAGLE-3 at T > 0) gets a torch generator per loop, seeded by (seed, request key, k), so its
    draws too are the loop's own whatever the batch."""
    loops = []
    for k in dict.fromkeys(ks):
        for i, p in enumerate(prompts):
            generator = torch.Generator().manual_seed(loop_seed(seed, k, keys[i]))
            loops.append(Loop(request=i, key=keys[i], loop_id=len(loops), k=k, prompt=list(p), generator=generator))
    return loops
