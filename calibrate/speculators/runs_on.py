"""Where each speculator kind runs as it is measured here: the engines whose method for the kind is the same
algorithm, so an acceptance length measured here holds there, and forcing an engine to it means what we
measured.

This is the one place for that fact, and it imports nothing: the exports and `lookup` (which a runner calls,
and which must stay fast and free of torch) read it without importing the kinds. Each kind's `runs_on()`
(calibrate.speculators.base) is its row here; the engines a kind launches on (its `engines`) must be in it
(tests/test_engine_methods.py). Engines are named as the kinds name them: the ones this toolkit launches,
"vllm", "sglang", "llama.cpp", and those it never launches, whose recipes InferenceX names: TensorRT-LLM
"trtllm", ATOM "atom", TileRT "tilert".
"""

from __future__ import annotations

RUNS_ON: dict[str, frozenset[str]] = {
    # TensorRT-LLM's Draft_Target: a draft model's greedy chain, as on the three engines it launches on.
    "draft": frozenset({"vllm", "sglang", "llama.cpp", "trtllm"}),
    # vLLM's prompt lookup only: SGLang's NGRAM and TensorRT-LLM's NGram are other algorithms (ngram.py).
    "ngram": frozenset({"vllm"}),
    # vLLM's `method: suffix` (ArcticInference inside the engine); no other engine has suffix decoding.
    "suffix": frozenset({"vllm"}),
    # TensorRT-LLM's Eagle3 and ATOM's eagle3: the same head's chain.
    "eagle3": frozenset({"vllm", "sglang", "trtllm", "atom"}),
    # The target's own MTP layers: SGLang's EAGLE (NEXTN), TensorRT-LLM's, ATOM's and TileRT's MTP chain them alike.
    "mtp": frozenset({"vllm", "sglang", "trtllm", "atom", "tilert"}),
    # An engine-only method is measured on an engine itself: none runs it as a kind of ours.
    "engine": frozenset(),
}


def runs_as_measured(kind: str | None, engine: str) -> bool:
    """Whether `engine` runs speculator `kind` as it is measured here. A kind this table does not list (None:
    an engine-only method, whose numbers are the engine's own) is never refused."""
    return kind not in RUNS_ON or engine in RUNS_ON[kind]


def measured_on(kind: str) -> str:
    """The engines `kind` runs on as measured, in words."""
    return ", ".join(sorted(RUNS_ON[kind])) or "no engine"
