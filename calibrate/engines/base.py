"""What every engine shares: the protocol the runner measures through, and the records it hands back.

The runner hands an engine a batch of rendered prompts and gets back, per prompt, one `Measured` per
(speculator name, k). It never touches a model itself, so the same runner drives a target loaded in this
process (calibrate.engines.in_process: greedy replay-once, the loop) and a 1-trillion-parameter model
behind a vLLM, SGLang or llama.cpp server (calibrate.engines.server_engine). calibrate.engines.factory
makes them from the plan's records of a pair (calibrate.plan_records).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from calibrate.data import RenderedPrompt
from calibrate.progress import TokenProgress
from calibrate.terms import StepCounts, TotalCounts

if TYPE_CHECKING:  # the MoE rows come from the in-process loop (torch); a server engine has none
    from calibrate.models import LoadedModel
    from calibrate.replay.experts import ExpertRow


@dataclass(frozen=True)
class Measured:
    """One request's outcome for one (speculator, k): its counts, the response they came from, and, for a
    server engine, the raw response fields kept for audit."""

    counts: StepCounts | TotalCounts
    generated_tokens: int
    finish_reason: str  # "eos" | "length"
    raw: dict[str, Any] | None = None
    experts: tuple[ExpertRow, ...] = ()  # the MoE verify-cost rows stored under this request (loop, experts on)
    # The engine audit (calibrate.engines.audit): steps of a speculating server's own list that contradict its
    # own tokens; None where not audited (T = 0, no step list, no in-process twin, or not a server).
    disagreeing_steps: int | None = None
    # Prompt tokens of this request that were not prefilled for it: taken from its conversation's cache
    # in this process, or reported by the engine's prefix cache; None where nothing was known or kept.
    cached_tokens: int | None = None


BatchResult = list[dict[tuple[str, int], Measured]]

# (tokens of one response, whether it starts inside a thinking block) -> a segment label per token
Labeller = Callable[[list[int], bool], list[str]]


@dataclass(frozen=True)
class TargetIdentity:
    """What a run records about its target when no model is loaded in this process."""

    name: str
    model_id: str
    fingerprint: str | None
    device: str
    # A connected server's model where it is not the pair's target (`[pairs.server] served_model`, checked
    # against what the server says it serves): a condition of the run, so its rows never pool with the
    # target's own. None where the server serves the target (or `server.model`, launched) itself.
    served_model: str | None = None


class SpeculatorFacts(Protocol):
    """What a run records of a speculator, whoever runs it: an in-process one (calibrate.speculators.base) or the
    one a server runs (server_engine.ServerSpeculator), named alike so their rows share a key."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]: ...

    @property
    def identity(self) -> tuple[str | None, str | None]: ...  # its weights and their fingerprint, where any


class Engine(Protocol):
    """Measures a batch of prompts for every (speculator, k) it serves, and reports what only loading and
    launching tell (calibrate.plan.settle fills it into the plan's run identities): how it is measured (the
    method, dtype, verification rule, response and feature sources) is the plan's, never re-stated here."""

    target: LoadedModel | TargetIdentity  # the model loaded in this process; what a server says it serves
    speculators: Sequence[SpeculatorFacts]  # as built: their weights' revisions (`identity`)
    ks: list[int]
    provenance: dict[str, Any] | None  # a server's command line, version and log; None in-process
    expert_layers: list[int]  # the MoE layers the verify-cost profile covers (none without it)

    def measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int],
                progress: TokenProgress | None = None, ids: Sequence[str] | None = None,
                conversations: Sequence[str] | None = None) -> BatchResult:
        """`keys` key each prompt's random streams; `progress(n)` is told of target tokens as they are made;
        `ids` are the responses' ids, which a server engine's errors name. `conversations` (whole
        trajectories): the conversation each prompt continues, one turn of each per batch, in order across
        batches; an engine reuses their prefixes where it can (prefix reuse)."""
        ...
