"""SGLang: `sglang.launch_server` per k; token ids to the native /generate; counts from `meta_info`.

`meta_info` fields (python/sglang/srt/managers/tokenizer_manager.py `_calculate_spec_decoding_metrics`,
later the helper `fill_spec_decoding_meta`): `spec_verify_ct` (verify passes, prefill excluded), accepted
drafts as `spec_accept_token_num` (older) or `spec_num_correct_drafts` (newer; alias `spec_accepted_drafts`),
proposed drafts as `spec_draft_token_num` / `spec_num_proposed_drafts` (alias `spec_proposed_drafts`),
computed as verify_ct * (speculative_num_draft_tokens - 1), and the histogram of accepted drafts per step
as `spec_accept_histogram` / `spec_correct_drafts_histogram` where the version has it.
AL = 1 + accepted / spec_verify_ct. SGLang's own `spec_accept_length` is completion_tokens / verify_ct,
which also counts the prefill's token: it is AL + 1 / verify_ct, not our AL.

Every reply is checked (calibrate.engines.replies) before it counts. `meta_info.finish_reason` is the
`to_json` of python/sglang/srt/managers/schedule_batch.py's finish reasons (sgl-project/sglang at fd3907ee4618):
{"type": "stop"} for FINISH_MATCHED_TOKEN / _STR / FINISHED_MATCHED_REGEX (an EOS token: calibrate sends no
stop string), {"type": "length"} for FINISH_LENGTH, {"type": "abort"} for FINISH_ABORT (refused), and null
while a request is unfinished (refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from calibrate.engines.adaptive import SGLANG_INFO
from calibrate.plan_records import Budget
from calibrate.engines.replies import Asked, Fields, FinishReasons
from calibrate.engines.server_engine import Generated, Reply, Served
from calibrate.engines.server import EngineError, http_json
from calibrate.model_names import resolve
from calibrate.terms import Sampling, TotalCounts

if TYPE_CHECKING:
    from calibrate.plan_records import ServerSettings

ACCEPTED = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
PROPOSED = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
HISTOGRAM = ("spec_correct_drafts_histogram", "spec_accept_histogram")
ENABLING_FLAGS = "--speculative-algorithm ... --speculative-num-steps k --speculative-num-draft-tokens k+1"


FINISH_TYPES: FinishReasons = {"stop": "eos", "length": "length", "abort": None}


def _first(meta: dict[str, Any], names: Sequence[str]) -> tuple[Any, str]:
    """The first of `names` that meta_info holds (the field's value and its name), else (None, names[0])."""
    return next(((meta[n], n) for n in names if meta.get(n) is not None), (None, names[0]))


def parse_meta(meta: dict[str, Any], reply: Fields, tokens: int, version: str | None) -> TotalCounts:
    """Map one reply's meta_info onto our counts; refuse a reply whose drafts per step contradict k."""
    k = reply.asked.k
    if meta.get("spec_verify_ct") is None:
        if tokens > 1:
            raise reply.fail("meta_info.spec_verify_ct", f"missing: sglang {version or '(unknown version)'} is not "
                                                         f"speculating; launch it with {ENABLING_FLAGS}")
        return TotalCounts(k=k, steps=0, accepted=0, drafted_tokens=0, tokens=tokens)
    steps = reply.count(meta["spec_verify_ct"], "meta_info.spec_verify_ct")
    (accepted, accepted_name), (proposed, proposed_name) = _first(meta, ACCEPTED), _first(meta, PROPOSED)
    if steps > 0 and accepted is None:
        raise reply.fail("meta_info", f"spec_verify_ct but no accepted-draft count (looked for "
                                      f"{', '.join(ACCEPTED)}) in sglang {version}")
    accepted = 0 if accepted is None else reply.count(accepted, f"meta_info.{accepted_name}")
    proposed = steps * k if proposed is None else reply.count(proposed, f"meta_info.{proposed_name}")
    if proposed != steps * k:
        raise reply.fail(f"meta_info.{proposed_name}", f"{proposed} proposed drafts over {steps} verify steps "
                                                       f"contradicts the configured k={k}: the server runs "
                                                       f"--speculative-num-draft-tokens "
                                                       f"{proposed // steps + 1 if steps else '?'}")
    reply.check_totals(steps, accepted, proposed, tokens, "meta_info")
    hist, hist_name = _first(meta, HISTOGRAM)
    if hist is not None:
        hist = reply.counts(hist, f"meta_info.{hist_name}")
        reply.check_histogram(hist, steps, accepted, f"meta_info.{hist_name}")
    return TotalCounts(k=k, steps=steps, accepted=accepted, drafted_tokens=proposed, tokens=tokens,
                       histogram=tuple(hist) if hist is not None else None)


# How SGLang spells k per algorithm (sgl-project/sglang python/sglang/srt/arg_groups/speculative_hook.py at
# 004c82e07d87, `handle_speculative_decoding` and its per-algorithm handlers; flags in arg_groups/fields/spec.py
# at 015c872628e3). A chain of k drafts is `--speculative-num-steps k --speculative-eagle-topk 1
# --speculative-num-draft-tokens k+1` (topk 1 forces draft tokens = steps + 1). DFLASH and DSPARK draft their
# whole block in one pass: steps and topk are forced to 1 and the block is num_draft_tokens = k + 1 (DSPARK's
# gamma + 1). NGRAM replaces topk with its BFS breadth (`--speculative-ngram-max-bfs-breadth`, a setting).
ONE_PASS_BLOCK = frozenset({"DFLASH", "DSPARK"})


def k_flags(algorithm: str, k: int) -> list[str]:
    steps = 1 if algorithm.upper() in ONE_PASS_BLOCK else k
    return ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(k + 1)]


def setting_flags(settings: dict[str, Any]) -> list[str]:
    """A kind's settings as SGLang flags: `key = value` -> `--key value`, `key = true` -> `--key`."""
    out: list[str] = []
    for key, value in settings.items():
        if value is True:
            out.append(f"--{key}")
        elif value is not False and value is not None:
            out += [f"--{key}", str(value)]
    return out


class SGLangBackend:
    name = "sglang"
    health = "/health"
    per_request_counts = True

    def plain_command(self, cfg: ServerSettings, host: str, port: int, budget: Budget, *extra: str) -> list[str]:
        """The server without speculation (plain-engine replay), `extra` flags before the config's own args.
        The radix cache is off unless whole trajectories reuse prefixes (`budget.prefix_reuse`)."""
        caching = [] if budget.prefix_reuse else ["--disable-radix-cache"]
        return [*(cfg.command.split() if cfg.command else ["python", "-m", "sglang.launch_server"]),
                "--model-path", resolve(cfg.model), "--host", host, "--port", str(port), *extra,
                *caching, "--context-length", str(budget.max_model_len),
                "--random-seed", str(budget.seed), *cfg.args]

    def command(self, served: Served, host: str, port: int, budget: Budget) -> list[str]:
        method, k = served.speculator.method, served.k
        return self.plain_command(served.pair.server, host, port, budget, "--speculative-algorithm", method.method,
                                  *setting_flags(method.settings), *k_flags(method.method, k))

    def describe(self, url: str, timeout: float) -> dict[str, Any]:
        info = http_json(self.name, url + "/get_server_info", timeout=timeout)
        if not isinstance(info, dict):
            raise EngineError(f"sglang at {url}: /get_server_info did not answer JSON")
        if not info.get("model_path"):  # every SGLang server names its model: this is something else
            raise EngineError(f"sglang at {url}: /get_server_info names no model_path: is this an SGLang server?")
        return {"engine_version": info.get("version"), "model": info.get("model_path"),
                "speculative_algorithm": info.get("speculative_algorithm"),
                "speculative_num_draft_tokens": info.get("speculative_num_draft_tokens"),
                SGLANG_INFO: info.get(SGLANG_INFO)}  # its adaptive verification (calibrate.engines.adaptive)

    def speculates(self, url: str, info: dict[str, Any], timeout: float) -> bool:
        return bool(info.get("speculative_algorithm"))

    def _generate(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling,
                  ) -> tuple[Fields, list[int], dict[str, Any], str]:
        """One /generate, checked: the reply, its output ids, its meta_info and why it stopped."""
        params = {"max_new_tokens": asked.max_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p or 1.0, "top_k": sampling.top_k or -1, "sampling_seed": sampling.seed}
        reply = asked.post("/generate", {"input_ids": list(prompt_ids), "sampling_params": params})
        resp = reply.obj(reply.body, "the reply")
        tokens = reply.token_ids(resp.get("output_ids"), "output_ids")
        meta = reply.obj(resp.get("meta_info"), "meta_info")
        reason = meta.get("finish_reason")
        kind = reason if reason is None else reply.obj(reason, "meta_info.finish_reason").get("type")
        finish = reply.finish(kind, "meta_info.finish_reason.type", FINISH_TYPES, tokens)
        return reply, tokens, meta, finish

    def complete(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling, info: dict[str, Any],
                 every_step: bool = False) -> Reply:
        reply, tokens, meta, finish = self._generate(asked, prompt_ids, sampling)
        counts = parse_meta(meta, reply, len(tokens), info.get("engine_version"))
        return Reply(tokens=tokens, finish_reason=finish, counts=counts, raw={"meta_info": meta, "output_ids": tokens},
                     cached_tokens=cached_tokens(reply, meta))

    def generate(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling,
                 info: dict[str, Any]) -> Generated:
        reply, tokens, meta, finish = self._generate(asked, prompt_ids, sampling)
        if meta.get("spec_verify_ct") is not None and reply.count(meta["spec_verify_ct"], "meta_info.spec_verify_ct"):
            raise reply.fail("meta_info.spec_verify_ct", f"the server speculates ({meta['spec_verify_ct']} verify "
                                                         "passes in one reply); plain-engine replay needs a server "
                                                         "started without --speculative-algorithm")
        return Generated(tokens=tokens, finish_reason=finish, raw={"meta_info": meta, "output_ids": tokens},
                         cached_tokens=cached_tokens(reply, meta))


def cached_tokens(reply: Fields, meta: dict[str, Any]) -> int | None:
    """Prompt tokens the radix cache held for a reply (`meta_info.cached_tokens`), None where it does not say."""
    return reply.optional_count(meta.get("cached_tokens"), "meta_info.cached_tokens")
