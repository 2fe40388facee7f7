"""Expert-touch profile of verify steps on an MoE target: distinct routed experts per layer per verify pass.

One verify step runs k + 1 positions through the target; on an MoE each position routes to its own top-k
experts, so the step reads the weights of the union of them. How many distinct experts that union holds
(per layer) sets what verification costs beyond a dense model, and it depends on how correlated the
routing of consecutive real tokens is. This module measures it from the router's own output, never by
re-implementing routing:

- `find_routers(model)`: the router modules a transformers MoE model declares itself, through
  `_can_record_outputs["router_logits"]` (the class transformers hooks for `output_router_logits`). In
  transformers 5 every MoE family (DeepSeek-V3 and its kin, GLM-4-MoE, Qwen2/3-MoE, Mixtral, GPT-OSS,
  OLMoE) returns `(router_logits, weights, indices)` from that module, indices (tokens, top_k) being the
  experts the layer then runs. A model without such a router is dense: `NotMoE`, one line.
- `ExpertRecorder`: a forward hook on each router, armed only around the loop's verify pass
  (`with recorder.verify(loop_ids, starts, chunks)`), so drafting and prefill are never counted. It keeps,
  per loop, every verify step's fed tokens and the expert set of each fed position (a Python int bitmask).
- `trace(loop_id, response)`: that loop's `ExpertTrace`: per verify step the union of its positions' experts
  per layer, and, per response token a plain decoder would feed (k = 0), that position's own experts. The
  k = 0 positions are the verify passes' positions that entered the response (pending token + accepted
  drafts): every response token but the last is fed to the target exactly once, as plain decoding does.
- `profile_rows(traces, batch_sizes)`: raw counts per (k, layer, batch size, routing) for each request
  (B = 1) and each group of B requests batched together (the union over their B(k+1) positions at each
  step t, members that finished dropping out), beside the same positions under SGLang's two simulated
  routings (`simulated_masks`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

ROUTINGS = ("router", "uniform", "round-robin")  # the model's own routing, then SGLang's simulated ones


class NotMoE(ValueError):
    """The target has no router transformers knows of: there is no expert profile to measure."""


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer of a target, as its modules define it (sizes in bytes of the loaded weights)."""

    layer: int  # decoder layer index (from the module name), or the router's ordinal when it has none
    name: str  # the router module's name
    routed_experts: int
    top_k: int
    shared_experts: int  # shared experts this layer always runs (counted apart: every step reads them)
    expert_bytes: int  # one routed expert's weights
    shared_bytes: int  # all of this layer's shared-expert weights


@dataclass
class ExpertTrace:
    """One loop's profile: `verify[s][l]` the expert bitmask step s touched in layer l, `positions[s]` the
    positions it fed; `plain[t][l]` the experts response token t routes to (a k = 0 step)."""

    verify: list[list[int]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # response index of each step's pending token
    tokens: list[list[int]] = field(default_factory=list)  # what each step fed (pending token + drafts)
    plain: list[list[int]] = field(default_factory=list)
    plain_positions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ExpertRow:
    """Raw counts of one (k, layer, batch size, routing) cell of one request (B = 1) or one batch of B
    requests (`members`: their indices in the engine's batch, the first being the request it is stored
    under): `distinct` sums, over the steps, the distinct routed experts each step touched."""

    k: int  # the run's k, or 0 (plain decoding)
    layer: int
    batch_size: int
    routing: str
    steps: int
    positions: int
    distinct: int
    members: tuple[int, ...]


def _router_class(model: torch.nn.Module) -> type | None:
    recorders = getattr(model, "_can_record_outputs", None) or {}
    rec = recorders.get("router_logits")
    return getattr(rec, "target_class", rec) if rec is not None else None


def _weight_bytes(module: torch.nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _parent(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


def find_routers(model: torch.nn.Module) -> list[tuple[MoeLayer, torch.nn.Module]]:
    """The model's MoE layers and their router modules, in forward order; NotMoE for a dense model."""
    cls = _router_class(model)
    found = [(name, m) for name, m in model.named_modules() if cls is not None and isinstance(m, cls)]
    if not found:
        raise NotMoE(f"{type(model).__name__} is not a mixture-of-experts model transformers routes "
                     "(no router module): `[run] experts = true` needs an MoE target")
    out = []
    for ordinal, (name, router) in enumerate(found):
        block = _parent(model, name)
        routed = int(router.weight.shape[0])
        shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
        config = getattr(model, "config", None)
        n_shared = (getattr(config, "n_shared_experts", None) or 1) if shared is not None else 0
        match = re.search(r"layers\.(\d+)\.", name)
        out.append((MoeLayer(
            layer=int(match.group(1)) if match else ordinal, name=name, routed_experts=routed,
            top_k=int(router.top_k), shared_experts=int(n_shared),
            expert_bytes=_weight_bytes(getattr(block, "experts", None)) // routed,
            shared_bytes=_weight_bytes(shared) + _weight_bytes(getattr(block, "shared_expert_gate", None)),
        ), router))
    return out


def masks_of(indices: torch.Tensor) -> list[int]:
    """Expert ids (n, top_k) -> one bitmask per row (bit e set when the row routes to expert e)."""
    return [sum(1 << e for e in set(row)) for row in indices.tolist()]


@dataclass
class _Step:
    start: int  # response index of the step's first fed token (the pending token)
    tokens: list[int]  # the fed tokens
    masks: list[list[int]]  # [position][layer]


class ExpertRecorder:
    """Forward hooks on a model's routers that record the experts of each verify pass's positions, per loop.

    Close it (or use it as a context manager) to remove the hooks."""

    def __init__(self, model: torch.nn.Module):
        sites = find_routers(model)
        self.layers = [layer for layer, _ in sites]
        self._armed: list[torch.Tensor] | None = None
        self._steps: dict[int, list[_Step]] = {}
        self._handles = [router.register_forward_hook(self._hook) for _, router in sites]

    def _hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._armed is None:
            return
        if not (isinstance(output, tuple) and len(output) == 3 and not output[2].is_floating_point()):
            raise RuntimeError(f"router {type(module).__name__} did not return (logits, weights, expert ids): "
                               "this transformers version routes differently than calibrate.replay.experts reads")
        self._armed.append(output[2].detach())  # (tokens, top_k) expert ids

    @contextlib.contextmanager
    def verify(self, loop_ids: Sequence[int], starts: Sequence[int], chunks: Sequence[Sequence[int]]) -> Iterator[None]:
        """Record the experts of the one target pass run inside: row r fed `chunks[r]` (right-padded to the
        widest) for loop `loop_ids[r]`, starting at response index `starts[r]`."""
        self._armed = []
        try:
            yield
            per_layer, self._armed = self._armed, None
        finally:
            self._armed = None
        if len(per_layer) != len(self.layers):
            raise RuntimeError(f"expected {len(self.layers)} router calls in one verify pass, got {len(per_layer)}")
        width = max(len(c) for c in chunks)
        if any(ix.shape[0] != len(chunks) * width for ix in per_layer):
            raise RuntimeError("a router saw another number of tokens than the verify pass fed")
        layer_masks = [masks_of(ix) for ix in per_layer]  # rows in the pass's (batch, position) order
        for r, (loop_id, start, chunk) in enumerate(zip(loop_ids, starts, chunks)):
            masks = [[layer_masks[l][r * width + j] for l in range(len(self.layers))] for j in range(len(chunk))]
            self._steps.setdefault(loop_id, []).append(_Step(start, list(chunk), masks))

    def trace(self, loop_id: int, response: Sequence[int]) -> ExpertTrace:
        """The loop's ExpertTrace, given the response it finally generated (which fed positions entered it)."""
        out = ExpertTrace()
        plain: dict[int, list[int]] = {}
        for step in self._steps.pop(loop_id, []):
            out.verify.append([_union(m[l] for m in step.masks) for l in range(len(self.layers))])
            out.positions.append(len(step.tokens))
            out.starts.append(step.start)
            out.tokens.append(step.tokens)
            for j, (token, masks) in enumerate(zip(step.tokens, step.masks)):
                index = step.start + j
                if index >= len(response) - 1 or response[index] != token:
                    break  # a rejected draft (and all after it), or the last token, which no step feeds
                plain[index] = masks
        out.plain = [plain[t] for t in sorted(plain)]
        out.plain_positions = [1] * len(out.plain)
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> ExpertRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _union(masks: Iterator[int] | Sequence[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def batch_union(members: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """Per-step, per-layer masks of B requests decoded together -> the batch's: at step t the union over the
    members still running (a member whose response ended leaves the batch)."""
    steps = max((len(m) for m in members), default=0)
    layers = next((len(m[0]) for m in members if m), 0)
    return [[_union(m[t][l] for m in members if t < len(m)) for l in range(layers)] for t in range(steps)]


def _batch_positions(members: Sequence[Sequence[int]]) -> list[int]:
    steps = max((len(m) for m in members), default=0)
    return [sum(m[t] for m in members if t < len(m)) for t in range(steps)]


def simulated_masks(routing: str, rows: int, layer: MoeLayer, rng: np.random.Generator) -> int:
    """The union mask of one forward pass of `rows` tokens under SGLang's simulated routing, which ignores
    the router. Read in sgl-project/sglang: python/sglang/srt/layers/moe/topk.py `select_experts` (commit
    000328a8cd54dd3aac97cd9977c39b5408034b26: uniform) and python/sglang/srt/hardware_backend/npu/moe/topk.py
    `_get_balanced_topk_ids` (round-robin; the CUDA path's version of it was not readable here):

    - "uniform" (SGLANG_SIMULATE_UNIFORM_EXPERTS): each token draws an offset o uniformly in [0, E) and
      takes experts (o + j * (E // top_k)) % E, j < top_k;
    - "round-robin" (SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS): token i of the pass takes entries i * top_k ..
      i * top_k + top_k - 1 of the even-then-odd expert list repeated (tensor-parallel rank 0: no shift),
      so a pass of n tokens touches min(E, n * top_k) experts.
    """
    e, k = layer.routed_experts, layer.top_k
    if routing == "uniform":
        offsets = rng.integers(0, e, size=(rows, 1))
        ids = (offsets + np.arange(k)[None, :] * max(e // k, 1)) % e
    elif routing == "round-robin":
        order = np.concatenate([np.arange(0, e, 2), np.arange(1, e, 2)])
        ids = np.resize(order, rows * k)
    else:
        raise ValueError(f"unknown simulated routing {routing!r} (known: uniform, round-robin)")
    return _union(1 << int(x) for x in np.unique(ids))


def _cells(masks: Sequence[Sequence[int]], positions: Sequence[int], layers: Sequence[MoeLayer], routing: str,
           rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """Per layer (steps, positions, summed distinct experts) of one request's or batch's steps."""
    out = []
    for l, layer in enumerate(layers):
        if routing == "router":
            distinct = sum(m[l].bit_count() for m in masks)
        else:
            distinct = sum(simulated_masks(routing, n, layer, rng).bit_count() for n in positions)
        out.append((len(positions), sum(positions), distinct))
    return out


def profile_rows(traces: Sequence[ExpertTrace], k: int, layers: Sequence[MoeLayer],
                 batch_sizes: Sequence[int], seed: int = 0) -> list[list[ExpertRow]]:
    """The rows stored per request (indexed like `traces`: one engine batch at one k): its own B = 1 rows,
    and, for the first member of each full group of B consecutive requests, that group's rows; each at the
    run's k and at k = 0, under every routing of ROUTINGS. A group of fewer than B left at the end of the
    batch is not counted (it is no batch of B)."""
    rng = np.random.default_rng(seed)
    out: list[list[ExpertRow]] = [[] for _ in traces]
    for b in dict.fromkeys(batch_sizes):
        for first in range(0, len(traces) - b + 1, b):
            group = traces[first:first + b]
            members = tuple(range(first, first + b))
            for at, masks, positions in (
                (k, batch_union([t.verify for t in group]), _batch_positions([t.positions for t in group])),
                (0, batch_union([t.plain for t in group]), _batch_positions([t.plain_positions for t in group])),
            ):
                for routing in ROUTINGS:
                    for layer, (steps, pos, distinct) in zip(layers, _cells(masks, positions, layers, routing, rng)):
                        out[first].append(ExpertRow(at, layer.layer, b, routing, steps, pos, distinct, members))
    return out
