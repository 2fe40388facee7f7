"""Suffix decoding drafter (SuffixDecoding, arXiv 2411.04975; vLLM `method: suffix`).

Where n-gram copies what followed the *latest* occurrence of the context's tail, suffix decoding keeps
counts: it matches the context's tail (every length up to `max_depth`) in a suffix trie of the request's
tokens, follows the most frequent continuation while its estimated probability (product of
count(child) / count(parent)) stays >= `min_token_prob`, proposes at most `max_spec_factor * match_len +
max_spec_offset` tokens, and keeps the candidate whose summed probabilities (score) is highest. Agentic
traffic repeats tool-call scaffolding and quoted code, which is where counts beat recency.

The trie is depth-limited (a suffix is stored up to `max_depth` tokens), so a match of length m can only
speculate `max_depth - m` tokens further; as in ArcticInference, shorter matches compete on score.

Scope: one trie over the request's own tokens (prompt + response so far). The cross-request cache of
earlier responses that a serving engine keeps is deliberately not modelled: what it holds depends on
which requests a server happened to see before, so it cannot be part of a reproducible, resumable
per-request measurement. Numbers from this drafter are therefore the cold-cache case.

Ties between equally frequent continuations follow ArcticInference's sibling-list order (see
`_sibling_order`), so the proposals are the ones vLLM's `method: suffix` makes with a cold cache:
`bench/suffix_vs_arctic.py` proposes with both at every position of real agentic turns and compares.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from calibrate.speculators.base import (
    BuildContext, Prefixes, Proposal, ReplayScorer, leading_matches,
)
from calibrate.speculators.configs import SUFFIX_DEFAULTS, SuffixSpeculatorConfig, suffix_params
from calibrate.speculators.per_loop import Proposer
from calibrate.speculators.registry import label
from calibrate.target_features import TargetFeatures

EPS = 1e-9


@dataclass(frozen=True)
class SuffixCandidate:
    """The continuation found from a match of `match_len` tokens: tokens and their probabilities."""

    match_len: int
    tokens: tuple[int, ...]
    probs: tuple[float, ...]


class SuffixIndex:
    """Depth-limited suffix trie over one token sequence, answerable as of any prefix length T.

    Every node stores the end positions of its occurrences, in increasing order (they are appended while
    the sequence is scanned left to right), so count(node, T) is a bisect and a query about the prefix
    seq[:T] needs no rebuild: the replay engine asks about every step of a response from one index, and the
    loop extends the index by the tokens it accepted.
    """

    def __init__(self, max_depth: int, tokens: Sequence[int] = ()):
        if max_depth < 1:
            raise ValueError(f"suffix max_depth must be >= 1 (got {max_depth})")
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self._children: list[dict[int, int]] = [{}]
        self._ends: list[list[int]] = [[]]
        self._depth: list[int] = [0]
        self._active: list[int] = []  # nodes of suffixes ending at the sequence end, shorter than max_depth
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        children, ends, depth = self._children, self._ends, self._depth
        for token in tokens:
            token = int(token)
            self.tokens.append(token)
            end = len(self.tokens)
            ends[0].append(end)
            active = []
            for node in (*self._active, 0):
                child = children[node].get(token)
                if child is None:
                    child = len(children)
                    children.append({})
                    ends.append([])
                    depth.append(depth[node] + 1)
                    children[node][token] = child
                ends[child].append(end)
                if depth[child] < self.max_depth:
                    active.append(child)
            self._active = active

    def count(self, node: int, at: int) -> int:
        """Occurrences of the node's string inside tokens[:at]."""
        return bisect_right(self._ends[node], at)

    def _match(self, pattern: Sequence[int], at: int) -> int | None:
        node = 0
        for token in pattern:
            node = self._children[node].get(token)
            if node is None or self.count(node, at) == 0:
                return None
        return node

    def _best_child(self, node: int, at: int) -> tuple[int, int, int] | None:
        """(token, child, count) of the most frequent continuation in tokens[:at]; ties by `_sibling_order`."""
        counted = [(n, token, child) for token, child in self._children[node].items()
                   if (n := self.count(child, at))]
        if not counted:
            return None
        top = max(n for n, _, _ in counted)
        tied = [(token, child) for n, token, child in counted if n == top]
        if len(tied) > 1:
            head = self._sibling_order(node, at)[0]
            tied = [tc for tc in tied if tc[1] == head]
        token, child = tied[0]
        return token, child, top

    def _sibling_order(self, node: int, at: int) -> list[int]:
        """The node's children in the order ArcticInference's sibling list has them after tokens[:at].

        Its list is kept sorted by count: a new child joins the tail; a child whose count grows to c + 1
        stays put unless its predecessor's count is <= c + 1, and then moves just before the first child
        with that predecessor's count. Which of two equally frequent continuations comes first follows from
        that history alone, so replaying the children's count increments in time order reproduces it.
        """
        events = sorted((end, child) for child in self._children[node].values()
                        for end in self._ends[child][:self.count(child, at)])
        order: list[int] = []
        count: dict[int, int] = {}
        for _, child in events:
            c = count.get(child, 0)
            count[child] = c + 1
            if c == 0:
                order.append(child)
                continue
            i = order.index(child)
            if i == 0 or count[order[i - 1]] > c + 1:
                continue
            group = count[order[i - 1]]
            j = next(j for j in range(i) if count[order[j]] == group)
            order.insert(j, order.pop(i))
        return order

    def _matches(self, at: int) -> list[tuple[int, int]]:
        """(match length, node) for every tail of tokens[:at] up to max_depth, longest first."""
        if at == len(self.tokens):  # the nodes of the tails are exactly the active nodes (below max_depth)
            return [(self._depth[node], node) for node in self._active]
        out = []
        for start in range(max(0, at - self.max_depth), at):
            node = self._match(self.tokens[start:at], at)
            if node is not None:
                out.append((at - start, node))
        return out

    def candidates(self, at: int, max_tokens: int, min_token_prob: float, max_spec_factor: float = math.inf,
                   max_spec_offset: float = 0.0) -> list[SuffixCandidate]:
        """For each tail length m of tokens[:at] (longest first), the greedy most-frequent path of up to
        min(max_tokens, floor(max_spec_factor * m + max_spec_offset)) tokens whose running probability stays
        >= min_token_prob."""
        if not 0 <= at <= len(self.tokens):
            raise ValueError(f"position {at} outside the indexed sequence (length {len(self.tokens)})")
        out = []
        for m, node in self._matches(at):
            tokens, probs, prob = [], [], 1.0
            cap = spec_cap(m, max_tokens, max_spec_factor, max_spec_offset)
            while len(tokens) < cap:
                best = self._best_child(node, at)
                if best is None:
                    break
                token, child, n = best
                prob *= n / self.count(node, at)
                if prob < min_token_prob - EPS:
                    break
                tokens.append(token)
                probs.append(prob)
                node = child
            out.append(SuffixCandidate(m, tuple(tokens), tuple(probs)))
        return out


def spec_cap(match_len: int, k: int, max_spec_factor: float, max_spec_offset: float) -> int:
    """How many tokens a match of match_len may propose: min(k, floor(factor * match_len + offset)), >= 0."""
    if math.isinf(max_spec_factor):
        return k
    return max(0, min(k, math.floor(match_len * max_spec_factor + max_spec_offset + 1e-6)))


def choose(candidates: Sequence[SuffixCandidate], k: int, max_spec_factor: float,
           max_spec_offset: float) -> SuffixCandidate:
    """The proposal: each candidate capped at min(k, floor(factor * match_len + offset)) tokens, the one with
    the highest summed probability (score) winning; ties go to the longer match, which comes first.

    Scores and probabilities are sums and products of count ratios, so equal ones can differ by rounding
    (6 * 2/3 against 2 * 10/11 + 3 * 8/11): comparisons allow EPS, or the tie rule would follow the
    last bit of the float arithmetic."""
    best, best_score = SuffixCandidate(0, (), ()), 0.0
    for c in candidates:
        cap = spec_cap(c.match_len, k, max_spec_factor, max_spec_offset)
        score = sum(c.probs[:cap])
        if score > best_score + EPS:
            best, best_score = SuffixCandidate(c.match_len, c.tokens[:cap], c.probs[:cap]), score
    return best


class SuffixSpeculator(Proposer):
    """Suffix decoding over the request's own tokens; parameters as vLLM's `suffix_decoding_*`."""

    kind = "suffix"

    @classmethod
    def build(cls, spec: SuffixSpeculatorConfig, ctx: BuildContext) -> SuffixSpeculator:
        return cls(max_depth=spec.max_depth, max_spec_factor=spec.max_spec_factor,
                   max_spec_offset=spec.max_spec_offset, min_token_prob=spec.min_token_prob,
                   cache_size=max(64, ctx.batch_size))

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, cache_size: int = 64):
        if max_depth < 1:
            raise ValueError(f"suffix max_depth must be >= 1 (got {max_depth})")
        if max_spec_factor < 0:
            raise ValueError(f"suffix max_spec_factor must be >= 0 (got {max_spec_factor})")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"suffix min_token_prob must be in [0, 1] (got {min_token_prob})")
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        # Loops call propose with a context that only grows per request; reusing that request's index
        # makes a step cost the new tokens, not the whole context. Keep one per request of a batch.
        self._indexes: list[SuffixIndex] = []
        self._cache_size = cache_size
        self._by_request: dict[int, SuffixIndex] = {}  # loops: one index per loop id

    @property
    def name(self) -> str:
        return label(self.kind, self.params, SUFFIX_DEFAULTS)

    @property
    def params(self) -> dict[str, Any]:
        return suffix_params(self)

    def best_at(self, index: SuffixIndex, at: int, k: int) -> SuffixCandidate:
        """The winning candidate (tokens, their probabilities, match length) as of tokens[:at]."""
        cands = index.candidates(at, k, self.min_token_prob, self.max_spec_factor, self.max_spec_offset)
        return choose(cands, k, self.max_spec_factor, self.max_spec_offset)

    def index_for(self, context: Sequence[int]) -> SuffixIndex:
        context = list(context)
        for i, index in enumerate(self._indexes):
            n = len(index.tokens)
            if n <= len(context) and index.tokens == context[:n]:  # extend() stores Python ints
                index.extend(context[n:])
                self._indexes.append(self._indexes.pop(i))  # most recently used last
                return index
        index = SuffixIndex(self.max_depth, context)
        self._indexes.append(index)
        del self._indexes[:-self._cache_size]
        return index

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        index = self.index_for(context)
        return Proposal(tokens=list(self.best_at(index, len(index.tokens), k).tokens))

    def start(self, loop_id: int, prompt: Sequence[int], features: TargetFeatures | None = None) -> None:
        self._by_request[loop_id] = SuffixIndex(self.max_depth, list(prompt))

    def extend(self, loop_id: int, tokens: Sequence[int], features: TargetFeatures | None = None) -> None:
        self._by_request[loop_id].extend(tokens)

    def draft(self, loop_id: int, k: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, *, top_k: int | None = None,
              top_p: float | None = None) -> Proposal:
        index = self._by_request[loop_id]
        return Proposal(tokens=list(self.best_at(index, len(index.tokens), k).tokens))

    def finish(self, loop_id: int) -> None:
        self._by_request.pop(loop_id, None)

    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int,
        features: Sequence[TargetFeatures] | None = None, prefixes: Prefixes | None = None,
    ) -> list[ReplayScorer]:
        """One index over prompt + response per request; a step at response position t asks it as of
        len(prompt) + t, so the response's future is never seen. Candidates are cached per position because
        every k walks the same positions."""

        def scorer(prompt: Sequence[int], response: Sequence[int]) -> ReplayScorer:
            index = SuffixIndex(self.max_depth, list(prompt) + list(response))
            offset = len(prompt)

            @lru_cache(maxsize=None)
            def cands(at: int) -> list[SuffixCandidate]:
                return index.candidates(at, max_k, self.min_token_prob, self.max_spec_factor, self.max_spec_offset)

            def run_at(t: int, k: int) -> tuple[int, int]:
                drafts = choose(cands(offset + t), k, self.max_spec_factor, self.max_spec_offset).tokens
                return leading_matches(drafts, response[t:], k), len(drafts)

            return run_at

        return [scorer(p, r) for p, r in zip(prompts, responses)]
