"""Verification of speculative drafts in plain torch: the specification the Triton kernels must match.

Layout (ragged, as in vLLM): a batch of B requests, request r proposing `drafted[r]` = k_r drafts.
- `draft_tokens`: (sum k_r,) int64, the drafts of every request, flattened in request order.
- `logits`: (sum (k_r + 1), V), the target's logits at the k_r + 1 verified positions of each request, in
  request order: row i of request r predicts the token after its i-th draft (row 0 predicts draft 0, row
  k_r is the bonus position).
- `draft_probs`: (sum k_r, V) float or None. The draft distribution q each draft was sampled from; None
  means deterministic drafters (n-gram, greedy drafts under the target-only rule): q = one-hot at the draft.

Outputs (`VerifyOutput`): emitted tokens (B, max k_r + 1) padded with -1, accepted drafts per request
(emitted = accepted + 1) and the analytic expected number of accepted drafts given the proposed drafts,
sum_i prod_{j<=i} min(1, p_j(d_j) / q_j(d_j)): same mean as the realised count, lower variance.

Rejection sampling, per request, walking its drafts in order:
    p = softmax(logits / T) restricted to the top-k / top-p set (renormalised), or one-hot(argmax) at T = 0;
    accept draft i  iff  p_i(d_i) > 0 and u_i * q_i(d_i) <= p_i(d_i), u_i ~ U(0, 1)   (i.e. u <= p/q);
    on the first rejection emit a sample of the residual max(p_i - q_i, 0) (normalised) and stop;
    if all k_r are accepted, emit a bonus sample of p at row k_r.
This emits exactly target-distributed tokens whatever q is (Leviathan et al. 2023, Chen et al. 2023).
A residual that is zero everywhere (p = q up to rounding, which then rejects with probability ~0) falls
back to a sample of p, so no zero-probability token is ever emitted.

Without draft probabilities (q one-hot at the draft: the target-only rule of vLLM v1 and SGLang's EAGLE, and
n-gram drafts) the test is coupled to the target's own keyed sample: every row draws its token y_i from p
(the same race a bonus row runs), draft i is accepted iff y_i = d_i, and the first row whose draft is not
y_i emits y_i. That is the rule above for q one-hot: P(accept) = p(d), and given a rejection y_i follows p
without d, the residual max(p - onehot(d), 0) normalised. Its emitted tokens are then the target's keyed
samples position by position, whatever the drafts and k: a loop's response is the response plain keyed
sampling generates (calibrate.replay.responses), which is what makes sampled replay-once and the loop
comparable run for run. At T = 0 y_i is the argmax, so greedy verification is the same rule.

Randomness comes from calibrate.kernels.rng, keyed by (seed, request id, absolute position, purpose):
u_i = lane_uniform(key(ACCEPT), 0), and samples are exponential races over key(SAMPLE) lanes. The Triton
kernels draw the very same numbers, so both kernels make identical decisions on identical inputs, and a
request's outcome does not depend on the batch around it.

Top-k / top-p: the kept set is {j : logit_j / T >= tau} for a per-row threshold tau (ties at the boundary
are kept, as in vLLM): top-k keeps logits >= the k-th largest; top-p then keeps the smallest
highest-probability prefix (of the top-k-renormalised distribution) whose mass reaches top_p. The threshold
needs a sort, so it is computed here in torch (`sampling_floor`) for the rows that ask for it, and the
Triton pass consumes it; rows without top-k / top-p skip it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calibrate.kernels import rng
from calibrate.terms import Sampling


@dataclass
class VerifyOutput:
    """Result of verifying one ragged batch."""

    tokens: torch.Tensor  # (B, max_k + 1) int64: emitted tokens, accepted drafts then one sampled token; -1 pad
    num_accepted: torch.Tensor  # (B,) int64: drafts accepted; the request emitted num_accepted + 1 tokens
    expected_accepted: torch.Tensor  # (B,) float32: sum_i prod_{j<=i} min(1, p_j/q_j) over the drafts


@dataclass
class RowResult:
    """Per-row intermediate of the verification pass (what the fused kernel writes before the combine step)."""

    p_draft: torch.Tensor  # (N,) float32: target probability of the row's draft (0 on bonus rows)
    q_draft: torch.Tensor  # (N,) float32: draft probability of the row's draft (0 on bonus rows)
    sample: torch.Tensor  # (N,) int64: residual (draft rows) or bonus sample (bonus rows); -1 where not raced
    # q one-hot: `sample` is every row's keyed target sample, and a draft is accepted iff it equals it
    coupled: bool = False


@dataclass
class Layout:
    """Index bookkeeping of a ragged batch; all tensors on the logits' device."""

    drafted: torch.Tensor  # (B,) int64
    row_start: torch.Tensor  # (B,) int64: first logits row of each request
    draft_start: torch.Tensor  # (B,) int64: first draft of each request in draft_tokens
    row_request: torch.Tensor  # (N,) int64: request of each logits row
    row_offset: torch.Tensor  # (N,) int64: index of the row inside its request, 0..k_r
    row_is_draft: torch.Tensor  # (N,) bool: row verifies a draft (offset < k_r); else it is the bonus row
    row_draft_index: torch.Tensor  # (N,) int64: index into draft_tokens (clamped to 0 on bonus rows)

    @property
    def batch(self) -> int:
        return self.drafted.shape[0]

    @property
    def max_k(self) -> int:
        return int(self.drafted.max()) if self.batch else 0


def make_layout(drafted: torch.Tensor, device: torch.device | str) -> Layout:
    drafted = torch.as_tensor(drafted, dtype=torch.int64).to(device)
    rows = drafted + 1
    row_start = torch.cumsum(rows, 0) - rows
    draft_start = torch.cumsum(drafted, 0) - drafted
    row_request = torch.repeat_interleave(torch.arange(drafted.shape[0], device=device), rows)
    row_offset = torch.arange(row_request.shape[0], device=device) - row_start[row_request]
    row_is_draft = row_offset < drafted[row_request]
    row_draft_index = torch.where(row_is_draft, draft_start[row_request] + row_offset, 0)
    return Layout(drafted, row_start, draft_start, row_request, row_offset, row_is_draft, row_draft_index)


def _per_request(value, batch: int, dtype: torch.dtype, device, default) -> torch.Tensor:
    """A per-request parameter given as None, a scalar or a (B,) sequence -> (B,) tensor."""
    if value is None:
        value = default
    t = torch.as_tensor(value, dtype=dtype)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"per-request parameter has shape {tuple(t.shape)}, expected ({batch},)")
    return t.to(device).contiguous()


def sampling_floor(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row threshold tau on temperature-scaled logits implementing top-k then top-p; -inf = keep all.

    scaled: (N, V) float32 = logits * (1 / T); top_k: (N,) int64 (0 = off); top_p: (N,) float32 (1 = off).
    The kept set is {j : scaled_j >= tau}; ties with the boundary value are kept.
    """
    n, vocab = scaled.shape
    tau = torch.full((n,), float("-inf"), dtype=torch.float32, device=scaled.device)
    need = (top_k > 0) & (top_k < vocab) | (top_p < 1.0)
    if not bool(need.any()):
        return tau
    rows = torch.nonzero(need).squeeze(1)
    s, _ = torch.sort(scaled[rows], dim=-1, descending=True)  # (R, V)
    k = top_k[rows]
    k = torch.where((k > 0) & (k < vocab), k, vocab)
    tau_k = s.gather(1, (k - 1).unsqueeze(1)).squeeze(1)  # (R,) the k-th largest
    kept = s >= tau_k.unsqueeze(1)  # (R, V): the top-k set (with ties), a prefix of the sorted row
    e = torch.where(kept, torch.exp(s - s[:, :1]), 0.0)
    cum = torch.cumsum(e / e.sum(-1, keepdim=True), dim=-1)  # (R, V)
    n_kept = kept.sum(-1)
    boundary = (cum < top_p[rows].unsqueeze(1)).sum(-1)  # first index whose cumulative mass reaches top_p
    boundary = torch.minimum(boundary, n_kept - 1)
    tau_p = s.gather(1, boundary.unsqueeze(1)).squeeze(1)
    tau[rows] = torch.maximum(tau_k, tau_p)
    return tau


def row_floors(logits: torch.Tensor, layout: Layout, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor) -> torch.Tensor:
    """(N,) threshold per logits row (-inf where the row's request asks for neither top-k nor top-p)."""
    req = layout.row_request
    t = temperature[req]
    tau = torch.full((logits.shape[0],), float("-inf"), dtype=torch.float32, device=logits.device)
    need = (t > 0) & (((top_k[req] > 0) & (top_k[req] < logits.shape[1])) | (top_p[req] < 1.0))
    if bool(need.any()):
        rows = torch.nonzero(need).squeeze(1)
        scaled = logits[rows].float() * inverse_temperature(t[rows]).unsqueeze(1)
        tau[rows] = sampling_floor(scaled, top_k[req][rows], top_p[req][rows])
    return tau


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """(N,) float32 1 / T per row (1 where T = 0): logits are scaled by multiplying with it, in both kernels."""
    t = temperature.float()
    return 1.0 / torch.where(t > 0, t, 1.0)


def masked_scaled(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """(N, V) float32 s = logits * (1 / T), -inf below the row's top-k / top-p floor."""
    s = logits.float() * inverse_temperature(temperature).unsqueeze(1)
    if bool(torch.isneginf(floor).all()):  # no row asks for top-k / top-p: nothing to mask (a vocabulary pass)
        return s
    return torch.where(s >= floor.unsqueeze(1), s, float("-inf"))


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """(N, V) float32 target distribution per row: masked softmax(logits/T), or one-hot argmax where T = 0.

    temperature and floor are per row. Written out (max, exp, sum, reciprocal, multiply) rather than
    torch.softmax so the arithmetic is the one the kernel does.
    """
    return probs_of_scaled(masked_scaled(logits, temperature, floor), logits, temperature)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """(N, V) float32: the distribution a row samples from under (T > 0, top-k, top-p), computed exactly as
    the verifier computes the target's p. A drafter sampling with the target's settings must draw from
    this, not from softmax(logits / T): outside the target's top-k / top-p set p = 0, so a draft drawn
    there is always rejected, and self-speculation (q = p) would not accept every draft."""
    n = logits.shape[0]
    t = torch.full((n,), float(temperature), dtype=torch.float32, device=logits.device)
    k = _per_request(top_k, n, torch.int64, logits.device, 0)
    p = _per_request(top_p, n, torch.float32, logits.device, 1.0)
    floor = sampling_floor(logits.float() * inverse_temperature(t).unsqueeze(1), k, p)
    return target_probs(logits, t, floor)


def sample_drafts(logits: torch.Tensor, sampling: Sampling, temperature: float, request_ids: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A model drafter's tokens (B,) from its logits (B, V), and q (B, V) at T > 0 (None at T = 0: argmax).

    q is softmax(logits / T) warped by the target's top-k / top-p exactly as the target's p is
    (`sampling_probs`), so self-speculation accepts every draft; the draw is the exponential race keyed by
    (seed, request, position, DRAFT), so a row's draft does not depend on the rows batched with it.
    `temperature` is the drafter's own (0 under target-only verification, which takes greedy drafts)."""
    if temperature <= 0:
        return logits.argmax(dim=-1), None
    q = sampling_probs(logits, temperature, sampling.top_k, sampling.top_p)
    keys = rng.stream_key(sampling.seed, request_ids, positions, rng.DRAFT).to(q.device)
    return rng.exponential_race(q, keys), q


def softmax_parts(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, inv_z) with softmax(s) = e * inv_z: e = exp(s - max) (N, V), inv_z = 1 / sum(e) (N, 1). Kept apart so
    that a caller needing p at a few rows or tokens multiplies only those (the same bits as the whole p)."""
    m = s.max(dim=-1, keepdim=True).values
    e = (s - m).exp_()  # in place: one (N, V) buffer for the whole softmax
    return e, 1.0 / e.sum(dim=-1, keepdim=True)


def probs_of_scaled(s: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """target_probs from the masked scaled logits s (so a caller that has s does not compute it twice)."""
    e, inv_z = softmax_parts(s)
    p = e.mul_(inv_z)
    greedy = temperature <= 0
    if not bool(greedy.any()):  # the one-hot rows would all be discarded: skip building them
        return p
    one_hot = torch.zeros_like(p).scatter_(1, logits.float().argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), one_hot, p)


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x with one zero row appended, so bonus rows can index row 0 even when a batch has no drafts at all."""
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])


def accepts(layout: Layout, p: torch.Tensor, q: torch.Tensor, accept_u: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the row's draft passes its test, p(d) > 0 and u * q(d) <= p(d) (u <= p / q)."""
    return layout.row_is_draft & (p > 0) & (accept_u * q <= p)


def row_accepts(layout: Layout, draft_tokens: torch.Tensor, rows: RowResult,
                accept_u: torch.Tensor | None) -> torch.Tensor:
    """(N,) bool: each row's accept decision: the coupled rule (the row's sample is its draft) for q
    one-hot, else the u <= p / q test."""
    if rows.coupled:
        d = torch.where(layout.row_is_draft, _padded(draft_tokens)[layout.row_draft_index], -1)
        return layout.row_is_draft & (rows.sample == d)
    return accepts(layout, rows.p_draft, rows.q_draft, accept_u)


def leading_accepts(layout: Layout, accept: torch.Tensor) -> torch.Tensor:
    """(B,) accepted drafts per request: its accepting rows before the first that does not (padding rows of the
    (B, max_k + 1) grid count as not accepting)."""
    grid = torch.zeros((layout.batch, layout.max_k + 1), dtype=torch.bool, device=accept.device)
    grid[layout.row_request, layout.row_offset] = accept
    return torch.cumprod(grid.long(), dim=1).sum(dim=1)


def _combine(layout: Layout, draft_tokens: torch.Tensor, rows: RowResult,
             accept_u: torch.Tensor | None) -> VerifyOutput:
    """Walk each request's rows: accepted prefix, then the residual/bonus sample of the first non-accepted row."""
    b, max_k = layout.batch, layout.max_k
    dev = draft_tokens.device
    p, q = rows.p_draft, rows.q_draft
    accept = row_accepts(layout, draft_tokens, rows, accept_u)  # (N,)
    alpha = torch.where(q > 0, torch.clamp(p / torch.where(q > 0, q, 1.0), max=1.0), (p > 0).float())
    alpha = torch.where(layout.row_is_draft, alpha, 0.0)

    # Scatter rows into a (B, max_k + 1) grid; padding rows count as "not accepted", alpha 0.
    grid_alpha = torch.zeros((b, max_k + 1), dtype=torch.float32, device=dev)
    grid_sample = torch.zeros((b, max_k + 1), dtype=torch.int64, device=dev)
    grid_draft = torch.full((b, max_k + 1), -1, dtype=torch.int64, device=dev)
    r, o = layout.row_request, layout.row_offset
    grid_alpha[r, o] = alpha
    grid_sample[r, o] = rows.sample
    grid_draft[r, o] = torch.where(layout.row_is_draft, _padded(draft_tokens)[layout.row_draft_index], -1)

    num_accepted = leading_accepts(layout, accept)  # (B,)
    expected = torch.cumprod(grid_alpha, dim=1).sum(dim=1)  # (B,)
    col = torch.arange(max_k + 1, device=dev).unsqueeze(0)
    last = torch.gather(grid_sample, 1, num_accepted.unsqueeze(1))  # (B, 1) token at the stopping row
    tokens = torch.where(col < num_accepted.unsqueeze(1), grid_draft, -1)
    tokens = torch.where(col == num_accepted.unsqueeze(1), last, tokens)
    return VerifyOutput(tokens=tokens, num_accepted=num_accepted, expected_accepted=expected)


def accept_uniforms(layout: Layout, seed: int, request_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(N,) float32 accept-test uniforms, keyed by (seed, request id, position + row offset, ACCEPT)."""
    keys = rng.stream_key(seed, request_ids[layout.row_request], positions[layout.row_request] + layout.row_offset,
                          rng.ACCEPT)
    return rng.lane_uniform(keys, torch.zeros_like(keys))


def sample_keys(layout: Layout, seed: int, request_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(N,) int64 keys of the per-vocabulary sampling noise of each row."""
    return rng.stream_key(seed, request_ids[layout.row_request], positions[layout.row_request] + layout.row_offset,
                          rng.SAMPLE)


@dataclass
class Batch:
    """Validated, device-placed inputs of a rejection verification (shared by both kernels)."""

    logits: torch.Tensor  # (N, V)
    draft_tokens: torch.Tensor  # (sum k,) int64
    draft_probs: torch.Tensor | None  # (sum k, V) or None
    layout: Layout
    temperature: torch.Tensor  # (B,) float32, 0 = greedy
    top_k: torch.Tensor  # (B,) int64, 0 = off
    top_p: torch.Tensor  # (B,) float32, 1 = off
    request_ids: torch.Tensor  # (B,) int64
    positions: torch.Tensor  # (B,) int64: absolute position (in the response) of each request's first draft
    seed: int


def prepare(logits, draft_tokens, drafted, *, draft_probs=None, temperature=1.0, top_k=None, top_p=None,
            seed: int = 0, request_ids=None, positions=None) -> Batch:
    """Check shapes and turn scalars / sequences into per-request device tensors."""
    dev = logits.device
    layout = make_layout(drafted, dev)
    b = layout.batch
    n_rows = int(layout.drafted.sum()) + b
    if logits.ndim != 2 or logits.shape[0] != n_rows:
        raise ValueError(f"logits must be (sum(k)+B={n_rows}, V), got {tuple(logits.shape)}")
    draft_tokens = torch.as_tensor(draft_tokens, dtype=torch.int64).to(dev)
    if draft_tokens.shape != (n_rows - b,):
        raise ValueError(f"draft_tokens must be (sum(k)={n_rows - b},), got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (n_rows - b, logits.shape[1]):
        raise ValueError(f"draft_probs must be ({n_rows - b}, {logits.shape[1]}), got {tuple(draft_probs.shape)}")
    return Batch(
        logits=logits, draft_tokens=draft_tokens, draft_probs=draft_probs, layout=layout,
        temperature=_per_request(temperature, b, torch.float32, dev, 1.0),
        top_k=_per_request(top_k, b, torch.int64, dev, 0),
        top_p=_per_request(top_p, b, torch.float32, dev, 1.0),
        request_ids=_per_request(request_ids, b, torch.int64, dev, list(range(b))),
        positions=_per_request(positions, b, torch.int64, dev, 0),
        seed=int(seed),
    )


def reference_rows(batch: Batch, accept_u: torch.Tensor | None = None) -> RowResult:
    """The per-row pass of the specification: p(d), q(d), and the residual / bonus sample of every row.

    Samples are exponential races with E_j = -log(u_j) from the row's SAMPLE stream:
    - with draft probabilities q: argmax_j max(p_j - q_j, 0) * (1 / E_j), falling back to argmax_j p_j / E_j
      when the residual is zero everywhere;
    - without (q = one-hot at the draft d; bonus rows: q = 0): every row's keyed sample of p, the race
      argmax_j s_j - log E_j in log space (s = masked logits / T), which the coupled rule accepts a draft
      by (module docstring). It needs no normaliser, which is why the kernel does it in the same pass as
      its max / sum-exp.
    Greedy rows (T = 0) emit the argmax.

    With draft probabilities and the accept-test uniforms `accept_u`, only the row each request stops at
    (its first rejected draft, or its bonus row) gets a sample, the others -1: that sample is the only one
    the combine step emits.
    On the CPU every pass over an (N, V) tensor costs (151,936 lanes a row for Qwen, N = B (k + 1) rows):
    so the races run on those B rows, in place, the fallbacks only on the rows that take them, and p is
    formed only there (p(d) needs the softmax's normaliser of every row, not p): the same arithmetic on
    the same numbers as the formulas above, bit for bit.
    """
    lay = batch.layout
    t_row = batch.temperature[lay.row_request]
    floor = row_floors(batch.logits, lay, batch.temperature, batch.top_k, batch.top_p)
    s = masked_scaled(batch.logits, t_row, floor)  # (N, V)
    e, inv_z = softmax_parts(s)  # p = e * inv_z on rows with T > 0
    greedy = t_row <= 0
    argmax = batch.logits.float().argmax(dim=-1) if bool(greedy.any()) else None  # p one-hot there
    d = torch.where(lay.row_is_draft, _padded(batch.draft_tokens)[lay.row_draft_index], 0)  # (N,)
    p_d = e.gather(1, d.unsqueeze(1)).squeeze(1) * inv_z.squeeze(1)
    if argmax is not None:
        p_d = torch.where(greedy, (argmax == d).float(), p_d)
    p_d = torch.where(lay.row_is_draft, p_d, 0.0)
    q = None if batch.draft_probs is None else batch.draft_probs.float()
    q_d = lay.row_is_draft.float()
    if q is not None:
        draft_rows = torch.nonzero(lay.row_is_draft).squeeze(1)  # row of each draft, in draft order
        q_d = torch.zeros_like(p_d)
        q_d[draft_rows] = q.gather(1, d[draft_rows].unsqueeze(1)).squeeze(1)

    rows = torch.arange(len(d), device=d.device)
    if accept_u is not None and q is not None:  # coupled rows (q None) need every row's sample to decide
        rows = lay.row_start + leading_accepts(lay, accepts(lay, p_d, q_d, accept_u))
    keys = sample_keys(lay, batch.seed, batch.request_ids, batch.positions)[rows]
    noise = rng.vocab_uniforms(keys, s.shape[1]).log_().neg_()  # (R, V) Exp(1) noise, -log(u)
    if q is None:
        raced = _keyed_race(s[rows], noise)
    else:
        raced = _residual_race(e[rows].mul_(inv_z[rows]), q, noise, lay.row_is_draft[rows],
                               lay.row_draft_index[rows])
    if argmax is not None:
        raced = torch.where(greedy[rows], argmax[rows], raced)
    sample = torch.full_like(d, -1)
    sample[rows] = raced
    return RowResult(p_draft=p_d, q_draft=q_d, sample=sample, coupled=q is None)


def _keyed_race(s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """argmax_j s_j - log E_j: each row's keyed sample of p (Gumbel-max in log space, no normaliser needed).
    s and e are overwritten."""
    return s.sub_(e.log_()).max(dim=-1).indices


def _residual_race(p: torch.Tensor, q: torch.Tensor, e: torch.Tensor, is_draft: torch.Tensor,
                   draft_index: torch.Tensor) -> torch.Tensor:
    """argmax_j max(p_j - q_j, 0) / E_j per row (bonus rows: q = 0, i.e. p), falling back to argmax_j p_j / E_j
    where the residual is zero everywhere. p, e: (R, V) of the raced rows; q: (sum k, V), a draft row's q
    at q[draft_index]. e is overwritten."""
    inv_e = e.reciprocal_()
    drafts = torch.nonzero(is_draft).squeeze(1)
    residual = p.clone().index_add_(0, drafts, q[draft_index[drafts]], alpha=-1.0).clamp_(min=0.0).mul_(inv_e)
    best_r, sample = residual.max(dim=-1)
    fallback = torch.nonzero(~(best_r > 0)).squeeze(1)
    if fallback.numel():
        sample[fallback] = (p[fallback] * inv_e[fallback]).argmax(dim=-1)
    return sample


def rejection_verify(logits: torch.Tensor, draft_tokens, drafted, *, draft_probs: torch.Tensor | None = None,
                     temperature=1.0, top_k=None, top_p=None, seed: int = 0, request_ids=None,
                     positions=None) -> VerifyOutput:
    """Rejection-sampling verification (reference). Per-request parameters: scalar or (B,).

    temperature 0 makes a request greedy (accept iff draft == argmax; the emitted token is the argmax).
    request_ids (default 0..B-1) and positions (default 0) key the random numbers; pass the request's
    stable id and the position of its first draft in the response so every decision uses fresh numbers.
    """
    batch = prepare(logits, draft_tokens, drafted, draft_probs=draft_probs, temperature=temperature,
                    top_k=top_k, top_p=top_p, seed=seed, request_ids=request_ids, positions=positions)
    u = accept_uniforms(batch.layout, batch.seed, batch.request_ids, batch.positions)
    return _combine(batch.layout, batch.draft_tokens, reference_rows(batch, accept_u=u), u)


def greedy_verify(logits: torch.Tensor, draft_tokens, drafted) -> VerifyOutput:
    """Greedy verification (reference): accept the prefix of drafts equal to the target's argmax, then emit
    the argmax at the first mismatch (or the bonus argmax). Ties go to the lowest token id."""
    lay = make_layout(drafted, logits.device)
    draft_tokens = torch.as_tensor(draft_tokens, dtype=torch.int64).to(logits.device)
    argmax = logits.float().argmax(dim=-1)  # (N,)
    d = torch.where(lay.row_is_draft, _padded(draft_tokens)[lay.row_draft_index], -1)
    hit = lay.row_is_draft & (d == argmax)
    rows = RowResult(p_draft=hit.float(), q_draft=lay.row_is_draft.float(), sample=argmax, coupled=True)
    out = _combine(lay, draft_tokens, rows, None)
    out.expected_accepted = out.num_accepted.float()
    return out
