"""Every engine reply checked before it counts: one check for every backend (vLLM, SGLang, llama.cpp) and both
ways of measuring through one (plain-engine replay and the engine's own speculation).

A reply is another process's word. Each client reads its fields through `Fields` here, so a reply that is not
what the engine documents is refused in one line naming the backend, the endpoint's URL, the request (the
response's id, as the store keys it) and the field: an EngineError, exit 4. The batch it belongs to is not
committed, so a resumed run asks again. Checked:
- every field has the type the client reads: objects (vLLM's `metrics` and `speculative_decoding`, llama.cpp's
  `timings`, SGLang's `meta_info`), lists, counts (non-negative integers: a bool, a float or a string is
  none), a histogram's keys (integers);
- token ids are integers inside the target tokenizer's vocabulary, and there are at most `max_tokens`;
- the finish reason is one the backend documents and says the response ended or the budget cut it (each
  backend's table, from its source); `null`, an abort, an error or an unknown reason is refused, never read as
  an end. An empty response passes only where the engine says it ended (EOS as its first token);
- each step accepted 0..k drafts, no more than it proposed, and proposed at most k;
- the steps fit the response: the prefill's token and every verify step but the last (which the budget may
  cut) emit all their tokens (accepted + 1) inside it, and the last at least one (an EOS is a token of the
  response: llama.cpp, vLLM), so 1 + the sum over all steps but the last of (accepted + 1) < its tokens;
  from totals alone (llama.cpp, SGLang, vLLM's summary and counters) steps + max(0, accepted - k) < its tokens;
- a histogram agrees with the totals beside it (its steps, its accepted drafts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from calibrate.engines.inflight import InFlight
from calibrate.engines.server import http_json, http_text
from calibrate.errors import EngineError

# A backend's finish reasons (from its source), each mapped to what ended the response: "eos" (the model's
# end, or another documented end), "length" (the budget), or None (documented, but the request was stopped
# for another reason: aborted, an error): refused, as any reason not in the table is.
FinishReasons = Mapping[str, str | None]


@dataclass(frozen=True)
class Asked:
    """One request to one server, as its reply is checked: the budget it asked, the target's vocabulary, the
    k it drafts at (0: a request that must not speculate), and how it is sent (a cancellable request)."""

    backend: str
    url: str  # the server's base URL
    request: str | None  # the response's id, as the store keys it (None: asked before any request)
    max_tokens: int = 0
    vocab: int = 0  # len(tokenizer): a token id is in [0, vocab)
    k: int = 0
    timeout: float = 600.0
    inflight: InFlight | None = None
    slot: int | None = None  # whole trajectories with prefix reuse: the conversation's server slot (llama.cpp)

    def post(self, path: str, body: dict[str, Any]) -> Fields:
        reply = http_json(self.backend, self.url + path, body, self.timeout, self.inflight, self.request)
        return Fields(self, path, reply)

    def get_text(self, path: str) -> Fields:
        reply = http_text(self.backend, self.url + path, self.timeout, self.inflight, self.request)
        return Fields(self, path, reply)


@dataclass(frozen=True)
class Fields:
    """One endpoint's reply to an `Asked` request, read field by field: each read returns the value as the
    client uses it, or raises one line naming backend, URL, request and field."""

    asked: Asked
    path: str
    body: Any

    def fail(self, field: str, problem: str) -> EngineError:
        a = self.asked
        request = "" if a.request is None else f"request {a.request}: "
        return EngineError(f"{a.backend} at {a.url}{self.path}: {request}{field}: {problem}")

    # -- types ----------------------------------------------------------------------------------------------
    def obj(self, value: Any, field: str, optional: bool = False) -> dict[str, Any]:
        """A JSON object; `optional`: None (absent) reads as {}."""
        if value is None and optional:
            return {}
        if not isinstance(value, dict):
            raise self.fail(field, f"{_shown(value)}, not an object")
        return value

    def items(self, value: Any, field: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(field, f"{_shown(value)}, not a list")
        return value

    def count(self, value: Any, field: str) -> int:
        """A non-negative integer (JSON's; a bool, a float such as 3.0 or a string is not one)."""
        if type(value) is not int or value < 0:
            raise self.fail(field, f"{_shown(value)}, not a count (a non-negative integer)")
        return value

    def optional_count(self, value: Any, field: str) -> int | None:
        """A count where the engine gives one, None where it does not (absent or null)."""
        return None if value is None else self.count(value, field)

    def counts(self, value: Any, field: str) -> list[int]:
        return [self.count(v, f"{field}[{i}]") for i, v in enumerate(self.items(value, field))]

    def token_ids(self, value: Any, field: str) -> list[int]:
        """Token ids of the target's vocabulary, at most max_tokens of them."""
        ids = self.items(value, field)
        vocab = self.asked.vocab
        for i, t in enumerate(ids):
            if type(t) is not int:
                raise self.fail(f"{field}[{i}]", f"{_shown(t)}, not an integer token id")
            if not 0 <= t < vocab:
                raise self.fail(f"{field}[{i}]", f"{t}, outside the target's vocabulary (ids 0 to {vocab - 1})")
        if len(ids) > self.asked.max_tokens:
            raise self.fail(field, f"{len(ids)} tokens, more than the max_tokens = {self.asked.max_tokens} asked")
        return ids

    # -- meaning --------------------------------------------------------------------------------------------
    def finish(self, value: Any, field: str, reasons: FinishReasons, tokens: Sequence[int]) -> str:
        """"eos" or "length", from a finish reason of `reasons`; an empty response only after an end."""
        documented = ", ".join(reasons)
        if value is None:
            raise self.fail(field, f"null: the engine did not say why the response stopped ({documented} "
                                   "documented), so it cannot be read as an end")
        if not isinstance(value, str) or value not in reasons:
            raise self.fail(field, f"{_shown(value)}, not a finish reason {self.asked.backend} documents "
                                   f"({documented})")
        ended = reasons[value]
        if ended is None:
            counted = " and ".join(r for r, e in reasons.items() if e)
            raise self.fail(field, f"{value!r}: the engine stopped the request, neither ended nor cut by the "
                                   f"budget (only {counted} say that)")
        if not tokens and ended == "length":
            raise self.fail(field, f"{value!r} with no token: max_tokens = {self.asked.max_tokens} cannot have "
                                   "ended an empty response")
        return ended

    def check_steps(self, accepted: Sequence[int], drafted: Sequence[int], tokens: int, field: str) -> None:
        """An engine's verify steps in order: 0 <= accepted <= drafted <= k each, and the list fits the
        response (every step but the last, and the prefill's token, inside it)."""
        k = self.asked.k
        if len(accepted) != len(drafted):
            raise self.fail(field, f"{len(accepted)} accepted counts for {len(drafted)} steps")
        for i, (a, d) in enumerate(zip(accepted, drafted)):
            if d > k:
                raise self.fail(f"{field}[{i}]", f"a step drafted {d} tokens, more than the configured k={k} (the "
                                                 "server runs a larger num_speculative_tokens)")
            if a > d:
                raise self.fail(f"{field}[{i}]", f"a step accepted {a} drafts of the {d} it proposed")
        last = 1 + sum(a + 1 for a in accepted[:-1])  # where the last step starts: after the prefill's token
        if accepted and last >= tokens:
            raise self.fail(field, f"{len(accepted)} steps accepting {sum(accepted)} drafts: the last starts at "
                                   f"token {last}, and the response has {tokens}")

    def check_totals(self, steps: int, accepted: int, drafted: int, tokens: int, field: str) -> None:
        """A request's totals: accepted <= drafted <= steps * k, and the steps fit the response."""
        k = self.asked.k
        if drafted > steps * k:
            raise self.fail(field, f"{drafted} drafts over {steps} steps, more than k={k} a step")
        if accepted > drafted:
            raise self.fail(field, f"{accepted} drafts accepted of the {drafted} proposed")
        last = steps + max(0, accepted - k)  # the earliest the last step can start (it accepts up to k)
        if steps and last >= tokens:
            raise self.fail(field, f"{steps} steps accepting {accepted} drafts: the last starts at token {last} or "
                                   f"later, and the response has {tokens}")

    def check_histogram(self, histogram: Sequence[int], steps: int, accepted: int, field: str) -> None:
        """Steps by accepted drafts (k + 1 bins) that agree with the totals beside them."""
        k = self.asked.k
        if len(histogram) != k + 1:
            raise self.fail(field, f"{len(histogram)} bins, not k+1={k + 1}: the server drafts a different k "
                                   "than configured")
        if sum(histogram) != steps or sum(a * n for a, n in enumerate(histogram)) != accepted:
            raise self.fail(field, f"{list(histogram)} counts {sum(histogram)} steps accepting "
                                   f"{sum(a * n for a, n in enumerate(histogram))} drafts, where the totals say "
                                   f"{steps} and {accepted}")


def _shown(value: Any) -> str:
    """A value as a message shows it, in JSON's words, cut to a line."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
