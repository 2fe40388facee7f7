"""One small interface for every drafter (draft model, n-gram, suffix, EAGLE-3, MTP).

A speculator declares what it needs from the target (`needs`: nothing, the hidden states entering given
layers, or the last hidden state), and engines hand exactly that with the tokens they verified.

Engines use a speculator in two ways:
- greedy replay-once: the target's response is fixed, so a speculator only has to say, for a step that
  starts at position t of that response, how many of its k drafts match it (`replay_scorers`, given the
  target's features over prompt + response when it needs them);
- loops (sampled, or step-by-step at temperature 0), per request id: `start` with the prompt, `draft` k
  tokens (optionally with their probabilities for rejection sampling), `extend` with each verified block,
  `finish`. A speculator owns its per-request state (KV cache, index) and rolls back its own speculative
  state when the next verified block arrives; nothing recognises a request by its tokens. A model-free
  drafter only says what follows a token context (`propose`); the default per-request methods keep the
  context for it. A draft model is the exception: it drafts a whole batch at once with its own batched
  KV cache (calibrate.speculators.draft_model).

Target features follow one invariant: after `start` / `extend`, the speculator holds the features of every
context position except the last (the last token is the one the target has not run yet: the prefill's
pending prompt token, or the token a step emitted). So `start` gets len(prompt) - 1 rows and each `extend`
with n new tokens gets n rows: the target's rows of the tokens it ran in that step.

A speculator that can do better than "propose at every step" for replay (a draft model scores every step
from one teacher-forced pass) overrides `replay_scorers`; the default proposes at each step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import numpy as np
import torch
from pydantic import AfterValidator, BaseModel, ConfigDict

from calibrate.models import check_written_path
from calibrate.speculators.runs_on import RUNS_ON

# run_at(t, k) -> (how many of the drafts proposed for k at response position t match the response from t,
# how many drafts were proposed). See calibrate.replay.steps.walk_steps.
ReplayScorer = Callable[[int, int], tuple[int, int]]


@dataclass(frozen=True)
class TargetNeeds:
    """What a speculator needs from the target's forward passes, besides tokens.

    `layers`: indices into transformers' `output_hidden_states` tuple, i.e. the hidden state ENTERING layer i
    (index 0 = embeddings), which is what vLLM captures as aux hidden state i. `last`: the final hidden state
    (after the model's final norm, as transformers returns it last).
    """

    layers: tuple[int, ...] = ()
    last: bool = False

    @property
    def any(self) -> bool:
        return bool(self.layers) or self.last


@dataclass
class TargetFeatures:
    """The target's features over a run of positions: `layers[i]` is (n, H) for each needed layer index i,
    `last` (n, H) when needed. Rows are positions, in order."""

    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    last: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> TargetFeatures:
        return TargetFeatures({i: h[start:stop] for i, h in self.layers.items()},
                              None if self.last is None else self.last[start:stop])


def select_features(hidden_states: Sequence[torch.Tensor], needs: TargetNeeds, row: int = 0) -> TargetFeatures:
    """The needed features of batch row `row` from a transformers `hidden_states` tuple ((B, n, H) each)."""
    return TargetFeatures({i: hidden_states[i][row] for i in needs.layers},
                          hidden_states[-1][row] if needs.last else None)


# Every table of a sweep config (calibrate.config, and each kind's speculator table): an unknown key is an
# error; NaN and infinity are refused for every float (a NaN temperature would be stored and exported as a
# key); and no value is coerced to another type (`strict`): `k = [true]`, `k = ["1"]`, `context_tokens =
# "256"` or `experts = "yes"` are mistakes, refused as any wrong type is. An int is still a float
# (`temperature = 1`).
CONFIG_TABLE = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


def _written_path_exists(name: str) -> str:
    try:
        check_written_path(name)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    return name


# A model name in a config table (a speculator's `model`, a server's `model`): resolved as the README says (an
# existing path, a built test model, else a hub id), so a name written as a path that does not exist is
# refused when the config is read, naming it, not when an engine fails to load it.
ModelName = Annotated[str, AfterValidator(_written_path_exists)]


class SpeculatorConfig(BaseModel):
    """Base of every kind's config table (`[[pairs]].speculators` entries): strict, immutable."""

    model_config = CONFIG_TABLE


@dataclass
class BuildContext:
    """What a kind's `build` may use: run settings, the loaded target, and models shared between pairs."""

    dtype: str
    device: str
    batch_size: int
    target: Any  # calibrate.models.LoadedModel
    loaded: dict[str, Any] = field(default_factory=dict)  # name -> LoadedModel, shared across pairs


@dataclass
class Proposal:
    """k draft tokens, and (for model drafters) the draft distribution q they were sampled from.

    `probs` is (k, vocab) float32 or None; None means the drafter is deterministic (n-gram), which rejection
    sampling treats as q = one-hot.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class EngineMethod:
    """How one serving engine names a speculator kind and spells its settings, k aside (each engine spells
    k its own way: calibrate.engines.<engine>). Model names in `settings` are already resolved to what
    the engine loads (a local folder, or a hub id as written)."""

    method: str  # vLLM speculative-config `method`, SGLang `--speculative-algorithm`, llama.cpp `--spec-type`
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Described:
    """A speculator as its runs record it (Speculator.name, .params, .identity), known before it is built;
    `draft_hash` is calibrate.models.AT_LOAD where only loading says (a hub id's revision)."""

    name: str
    params: dict[str, Any]
    draft_id: str | None = None
    draft_hash: str | None = None


# (spec, weights) -> an engine method's settings; a ValueError says why this config cannot run there.
Settings = Callable[[Any, Callable[[str], str]], dict[str, Any]]


def needs(condition: bool, reason: str) -> None:
    """In a Settings function: refuse a config an engine cannot run, saying why."""
    if not condition:
        raise ValueError(reason)


def no_settings(spec: Any, weights: Callable[[str], str]) -> dict[str, Any]:
    return {}


def label(kind: str, params: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """A model-free speculator's name: its kind, plus each parameter that differs from its default.

    Names key runs and table rows, so two configurations must never share one ('ngram' with prompt_lookup_max 3 and
    with 5 would otherwise pool into one AL); the default configuration keeps the bare kind.
    """
    changed = [f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
               for key, value in params.items() if value != defaults[key]]
    return kind + (":" + ",".join(changed) if changed else "")


def leading_matches(drafts: Sequence[int], target: Sequence[int], limit: int) -> int:
    """Length of the common prefix of drafts and target, over at most `limit` positions."""
    n = 0
    for d, y in zip(drafts[:limit], target[:limit]):
        if d != y:
            break
        n += 1
    return n


class Speculator(ABC):
    """A drafter. `name` labels its runs; `params` is stored as provenance and is part of the run identity.

    Each kind also declares its config table (`config_model`, a SpeculatorConfig subclass with a `kind`
    Literal) and how to build itself from it (`build`); calibrate.speculators.registry lists the kinds.
    """

    kind: str = ""
    needs: TargetNeeds = TargetNeeds()
    config_model: ClassVar[type[SpeculatorConfig] | None] = None
    in_process: ClassVar[bool] = True  # False: the kind runs only inside a serving engine
    # True for a model drafter: every verify step drafts k, so an engine that lists only drafted steps
    # (vLLM) lists them all; model-free drafters propose nothing at some steps.
    drafts_every_step: ClassVar[bool] = False
    # What of the target's hidden states the kind drafts from, known before any instance (its `needs` say
    # which layers): None, "layers" (the inputs of given layers: EAGLE-3, what vLLM's extract_hidden_states
    # captures) or "last" (the final hidden state: MTP).
    hidden_states: ClassVar[str | None] = None
    # How each serving engine runs a config of this kind: engine -> (its method name, (spec, weights) -> the
    # method's settings, raising ValueError with the reason where this config cannot run there). The one
    # place a kind's engine spellings live: the engine backends read them and hold no list of kinds.
    engines: ClassVar[Mapping[str, tuple[str, Settings]]] = {}

    @classmethod
    def runs_on(cls) -> frozenset[str]:
        """Every engine that runs this kind as it is measured here: those it launches on, and those it never
        launches whose method for it is the same algorithm (calibrate.speculators.runs_on, the one table of it,
        which the exports and lookup read without importing the kinds)."""
        return RUNS_ON.get(cls.kind, frozenset())

    @classmethod
    def check(cls, spec: SpeculatorConfig, target_name: str, target_tokenizer: Any) -> None:
        """Refuse a config that cannot work with this target, before any weights load (default: nothing)."""

    @classmethod
    def config_name(cls, spec: SpeculatorConfig, target: str) -> str:
        """The name a config's speculator measures under, in-process and through every engine alike, so their
        rows share a key. `target` is the pair's target as written (MTP is named after it)."""
        raise NotImplementedError(f"speculator kind {cls.kind!r} has no name rule")

    @classmethod
    def engine_method(cls, spec: SpeculatorConfig, engine: str,
                      weights: Callable[[str], str]) -> EngineMethod | None:
        """How `engine` ("vllm", "sglang", "llama.cpp") runs this speculator, or None where it has no such
        method; a ValueError says why this config cannot run there. `weights(name)` resolves a model name
        to what the engine should load."""
        if engine not in cls.engines:
            return None
        method, settings = cls.engines[engine]
        return EngineMethod(method, settings(spec, weights))

    @classmethod
    def described(cls, spec: SpeculatorConfig, target: str) -> Described:
        """What a speculator built from `spec` says of itself (its `name`, `params` and `identity`), read from
        its config and config files alone: the measurement plan (calibrate.plan) names its runs with it before
        any weights load. `target` is the name the target is loaded under. Kinds that run in this process
        override it."""
        raise NotImplementedError(f"speculator kind {cls.kind!r} runs only inside a serving engine")

    @classmethod
    def build(cls, spec: SpeculatorConfig, ctx: BuildContext) -> Speculator:
        raise NotImplementedError(f"speculator kind {cls.kind!r} cannot be built from a config")

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]:
        return {}

    @property
    def identity(self) -> tuple[str | None, str | None]:
        """(model id, content hash) of a model drafter, for provenance; (None, None) for model-free ones."""
        return None, None

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        """Propose up to k draft tokens to follow `context` (token ids), from the tokens alone: what the
        default `draft` and `replay_scorers` ask of a model-free drafter. A draft model drafts a whole batch
        with its own KV cache instead (calibrate.speculators.draft_model.DraftModelSpeculator.draft_batch)."""
        raise NotImplementedError(f"speculator {self.name!r} does not propose from a token context")

    # -- loops: per-request state ---------------------------------------------------------------------
    # The default keeps each request's context and proposes from it; speculators with a model state
    # (EAGLE-3, MTP) override all four.

    def start(self, request_id: int, prompt: Sequence[int], features: TargetFeatures | None = None) -> None:
        """A request begins: its prompt, and the target's features of every prompt position but the last."""
        self._contexts()[request_id] = list(prompt)

    def extend(self, request_id: int, tokens: Sequence[int], features: TargetFeatures | None = None) -> None:
        """The target verified a step: the context grew by `tokens`; features cover the positions it ran."""
        self._contexts()[request_id].extend(int(t) for t in tokens)

    def draft(self, request_id: int, k: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, *, top_k: int | None = None,
              top_p: float | None = None) -> Proposal:
        """Up to k drafts to follow the request's current context.

        `top_k` / `top_p` are the target's sampling filters: a speculator that samples from its own q warps
        q by them as the target's p is (`calibrate.kernels.reference.sampling_probs`), so self-speculation
        accepts every draft. Model-free proposals (and `propose`) have no logits to warp and ignore them."""
        return self.propose(self._contexts()[request_id], k, temperature, generator)

    def finish(self, request_id: int) -> None:
        self._contexts().pop(request_id, None)

    def _contexts(self) -> dict[int, list[int]]:
        # Created on first use, so subclasses need not call a base __init__.
        return self.__dict__.setdefault("_request_contexts", {})

    # -- greedy replay-once ---------------------------------------------------------------------------

    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int,
        features: Sequence[TargetFeatures] | None = None,
    ) -> list[ReplayScorer]:
        """One scorer per (prompt, response) for greedy replay-once; `features[i]` covers prompt + response
        of request i when the speculator needs them. Default: propose at each step."""

        def scorer(prompt: Sequence[int], response: Sequence[int]) -> ReplayScorer:
            # One array per request and a view per step: copying a 100k-token context at every step
            # would cost more than the proposal.
            full = np.asarray([*prompt, *response], dtype=np.int64)
            full.setflags(write=False)

            def run_at(t: int, k: int) -> tuple[int, int]:
                drafts = self.propose(full[:len(prompt) + t], k).tokens[:k]
                return leading_matches(drafts, response[t:], k), len(drafts)

            return run_at

        return [scorer(p, r) for p, r in zip(prompts, responses)]


def chain_replay_scorers(
    name: str, chain_drafts: Callable[..., np.ndarray], prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]], max_k: int, features: Sequence[TargetFeatures] | None,
) -> list[ReplayScorer]:
    """Replay scorers for a head that chain-drafts from the target's hidden states (EAGLE-3, MTP):
    `chain_drafts(prompt, response, features, max_k)` gives every position's max_k greedy drafts at once."""
    if features is None:
        raise ValueError(f"{name}: replay needs the target's hidden states")
    scorers: list[ReplayScorer] = []
    for prompt, response, feats in zip(prompts, responses, features):
        drafts = chain_drafts(prompt, response, feats, max_k)

        def run_at(t: int, k: int, drafts: np.ndarray = drafts, response: Sequence[int] = response):
            return leading_matches(drafts[t, :k].tolist(), response[t:], k), k  # a chain always drafts k

        scorers.append(run_at)
    return scorers
