"""The terms every part of calibrate shares, in a module that imports no torch: how a request samples
(`Sampling`), the largest k (`MAX_K`, `check_k`) and the count records an engine hands to the store.

The HTTP clients, the config, the tables and the consumers speak these terms without loading the in-process
engines (torch, transformers), so `calibrate show`, `export`, `lookup` and a config check start in a
fraction of a second.

The count records: per request, per k, per segment, a histogram of accepted drafts. Every engine (greedy
replay-once, sampled loop, server backends) produces them, and the store keeps them as they are; statistics
are derived later (calibrate.tables.stats), never here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from calibrate.data.segments import SEGMENTS

# The largest k anything here takes: config keys ([sweep] k, [pairs.server] k), CLI options (--k of show,
# export and lookup, with or without --extrapolate) and the in-process engines' arguments. Far above every
# engine's own largest k (vLLM, SGLang and llama.cpp serve single digits to about 16), and low enough that a
# typo (k = 100000) fails at once instead of allocating gigabytes for minutes.
MAX_K = 64


def check_k(ks: Iterable[int], what: str = "k") -> None:
    """Refuse any k outside 1..MAX_K, in one line naming where it came from (`what`: a key or an option)."""
    bad = [k for k in ks if not 1 <= k <= MAX_K]
    if bad:
        raise ValueError(f"{what} must be 1..{MAX_K} (calibrate's largest k), got {', '.join(map(str, bad))}")


@dataclass(frozen=True)
class Sampling:
    """How a request samples: what the target's p is warped by, and the seed its random streams are keyed by.
    The one record of it, for the in-process loop, the drafters and the server engines' request bodies."""

    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0


@dataclass
class SegmentCounts:
    """Outcome of the steps that started in one segment of one response."""

    hist: np.ndarray  # int64, shape (k+1,): hist[a] = steps that accepted exactly a drafts
    tokens: int = 0  # target tokens emitted in this segment (censored steps included)
    censored_steps: int = 0  # steps cut by max_new_tokens before their outcome was known
    expected_accepted: float | None = None  # sum over steps of the analytic E[accepted] (sampled loop only)
    # Over the histogram's steps: drafts actually proposed, and steps that proposed none (counted in
    # hist[0]). Model-free drafters propose fewer than k or nothing; engines' own logs (vLLM's "Mean
    # acceptance length", "draft acceptance rate") count only drafted steps and proposed drafts.
    drafted_tokens: int = 0
    empty_steps: int = 0


def position_bin(position: int) -> int:
    """The running-position bin of a step that starts at response token `position` (0-based; steps start at 1,
    the prefill emits token 0): floor(log2(position)), so bins 0, 1, 2, ... hold positions 1, 2-3, 4-7, ...
    AL falls along a response (output-length decay, arXiv 2605.09329); these bins measure it."""
    if position < 1:
        raise ValueError(f"a step starts at response position >= 1 (the prefill emits position 0), got {position}")
    return position.bit_length() - 1


@dataclass
class StepCounts:
    """Acceptance outcome of one request at one draft length k, per segment, and per running-position bin
    (`position_bin` of the token each step starts at: histograms over all segments) where the engine gave
    the step's position."""

    k: int
    segments: dict[str, SegmentCounts] = field(default_factory=dict)
    positions: dict[int, np.ndarray] = field(default_factory=dict)  # bin -> hist (k+1,) of its steps

    def _segment(self, segment: str) -> SegmentCounts:
        if segment not in SEGMENTS:
            raise ValueError(f"unknown segment {segment!r} (expected one of {', '.join(SEGMENTS)})")
        if segment not in self.segments:
            self.segments[segment] = SegmentCounts(hist=np.zeros(self.k + 1, dtype=np.int64))
        return self.segments[segment]

    def add_step(self, segment: str, accepted: int | None, tokens: int, proposed: int,
                 expected: float | None = None, position: int | None = None) -> None:
        """Record one step that started in `segment` at response token `position` (None: not known) and
        proposed `proposed` drafts; `accepted=None` marks a censored step (in no histogram)."""
        seg = self._segment(segment)
        seg.tokens += tokens
        if accepted is None:
            seg.censored_steps += 1
            return
        if not 0 <= accepted <= proposed <= self.k:
            raise ValueError(f"need 0 <= accepted ({accepted}) <= proposed ({proposed}) <= k ({self.k})")
        seg.hist[accepted] += 1
        if position is not None:
            bin_hist = self.positions.setdefault(position_bin(position), np.zeros(self.k + 1, dtype=np.int64))
            bin_hist[accepted] += 1
        seg.drafted_tokens += proposed
        seg.empty_steps += proposed == 0
        if expected is not None:
            seg.expected_accepted = (seg.expected_accepted or 0.0) + float(expected)

    def add_tokens(self, segment: str, tokens: int) -> None:
        """Tokens emitted outside any step: the first response token, which the prefill pass produces."""
        self._segment(segment).tokens += tokens

    @property
    def hist(self) -> np.ndarray:
        """Histogram over all segments."""
        total = np.zeros(self.k + 1, dtype=np.int64)
        for seg in self.segments.values():
            total += seg.hist
        return total

    @property
    def tokens(self) -> int:
        return sum(seg.tokens for seg in self.segments.values())


@dataclass(frozen=True)
class RequestOutcome:
    """What happened to one request, independent of speculator and k (shared by all runs of a generation)."""

    request_id: str
    conversation_id: str
    turn: int
    turn_depth: int  # which answer of the conversation (ReplayRequest.depth)
    prompt_tokens: int  # after truncation
    truncated_tokens: int  # dropped from the left to fit the context budget (before = prompt + truncated)
    generated_tokens: int
    finish_reason: str  # "eos" | "length"
    sample: int = 0  # which of the request's sampled responses (`[sweep] samples`) this is
    disagreeing_steps: int | None = None  # the engine audit: steps whose counts contradict the tokens
    prompt_sha256: str | None = None  # of the prompt's token ids as measured (RenderedPrompt.digest): resume checks it
    cached_tokens: int | None = None  # prompt tokens not prefilled for it (prefix reuse); None: not known


# Counts a server engine reports for a whole response cannot be split by segment: they are stored under
# this segment name, and per-segment views leave them out rather than guess a split.
UNSEGMENTED = "unsegmented"


@dataclass
class TotalCounts:
    """What a server engine reports for one request at draft length k: totals, and more where it has them.

    Every engine gives verify steps (directly, or as drafted tokens / k where k is fixed) and accepted
    drafts; vLLM's per-position counters add `per_position` (steps whose draft at position i was accepted),
    SGLang's newer `meta_info` adds the full `histogram`. Nothing missing is derived: a statistic that
    needs a histogram is "not available from this engine".
    """

    k: int
    steps: int
    accepted: int
    drafted_tokens: int
    tokens: int  # target tokens of the response
    per_position: tuple[int, ...] | None = None
    histogram: tuple[int, ...] | None = None
    censored_steps: int = 0  # steps left out of the counts above because a budget cut hid their outcome

    def __post_init__(self) -> None:
        k = self.k
        if self.steps < 0 or not 0 <= self.accepted <= self.steps * k or self.drafted_tokens > self.steps * k:
            raise ValueError(f"inconsistent engine counts: steps={self.steps} accepted={self.accepted} "
                             f"drafted={self.drafted_tokens} at k={k}")
        if self.per_position is not None and (len(self.per_position) != k
                                              or sum(self.per_position) != self.accepted):
            raise ValueError(f"per-position counts {self.per_position} do not sum to accepted={self.accepted} "
                             f"over k={k} positions")
        if self.histogram is not None and (
                len(self.histogram) != k + 1 or sum(self.histogram) != self.steps
                or sum(a * n for a, n in enumerate(self.histogram)) != self.accepted):
            raise ValueError(f"histogram {self.histogram} disagrees with steps={self.steps}, "
                             f"accepted={self.accepted} at k={k}")
