"""A speculating engine's adaptive verification: whether it sizes each request's verification (or its draft
length) itself, from the confidence or acceptance it sees, instead of verifying the k drafts it was given.

It moves AL, and the two sides of InferenceX's injection differ in it: the golden curves were collected with
it off, AgentX serves DSpark with it (SemiAnalysisAI/InferenceX golden_al_distribution/README.md at 843c6254f,
"DSpark note": ATOM refuses forced acceptance with its confidence scheduler). So each run counted from an
engine's own speculation records the engine's setting (`runs.adaptive_verification`): "on", "off", or "not
reported" where a connected server does not say. How each backend spells it, at the sources this project
follows:

    vllm       `enable_adaptive_verification` in --speculative-config (bool, default false; sizes the
               draft-verification budget from per-request confidence, method "dspark" only):
               vllm-project/vllm vllm/config/speculative.py at 002e77c1f0ef. Launched: read from the
               speculative config on its command line (a kind's settings and server.speculative_config land
               there); connected: vLLM reports no speculative config (/version, /v1/models), so "not reported".
    sglang     `--speculative-adaptive` (bool, default false; adjusts the number of draft steps from the
               acceptance rate, tuned by --speculative-adaptive-config): sgl-project/sglang
               python/sglang/srt/arg_groups/fields/spec.py at 015c872628e3. Launched: the flag on its command
               line; connected: `speculative_adaptive` in /get_server_info (its server arguments).
    llama.cpp  has no such setting: nothing is recorded.

ATOM's DSpark confidence scheduler (`--dspark-config '{"confidence_schedule": true}'`) is the same idea; this
project drives no ATOM server.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ON, OFF, NOT_REPORTED = "on", "off", "not reported"

VLLM_KEY = "enable_adaptive_verification"
VLLM_FLAG = "--speculative-config"
SGLANG_FLAG = "--speculative-adaptive"
SGLANG_INFO = "speculative_adaptive"


def _word(value: Any) -> str:
    """A setting's value as recorded: on / off, or not reported where the engine gave no boolean."""
    if isinstance(value, bool):
        return ON if value else OFF
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return ON if value.lower() == "true" else OFF
    return NOT_REPORTED


def _flag_values(command: Sequence[str], flag: str) -> list[str]:
    """Every value given to `flag` on a command line, as `flag VALUE` or `flag=VALUE`, in order."""
    out = []
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            out.append(command[i + 1])
        elif arg.startswith(flag + "="):
            out.append(arg[len(flag) + 1:])
    return out


def vllm_setting(command: Sequence[str] | None, info: Mapping[str, Any]) -> str:
    """vLLM: the key in the last --speculative-config that sets it (vLLM's JSON argument, or its dotted form
    `--speculative-config.enable_adaptive_verification VALUE`); a connected server does not report it."""
    if command is None:
        return NOT_REPORTED
    value: Any = False  # vLLM's default
    for text in _flag_values(command, VLLM_FLAG):
        try:
            config = json.loads(text)
        except ValueError:
            return NOT_REPORTED  # not JSON we can read: say so rather than guess
        if isinstance(config, dict) and VLLM_KEY in config:
            value = config[VLLM_KEY]
    for text in _flag_values(command, f"{VLLM_FLAG}.{VLLM_KEY}"):  # the dotted form, `... true`
        value = text
    return _word(value)


def sglang_setting(command: Sequence[str] | None, info: Mapping[str, Any]) -> str:
    """SGLang: the flag on a launched server's command line, or what a connected one's server info says."""
    if command is not None:
        return ON if SGLANG_FLAG in command else OFF  # a store-true flag
    return _word(info.get(SGLANG_INFO))


# One place: the backends that have the setting, and how it is read.
READERS: dict[str, Callable[[Sequence[str] | None, Mapping[str, Any]], str]] = {
    "vllm": vllm_setting,
    "sglang": sglang_setting,
}


def adaptive_verification(backend: str, command: Sequence[str] | None, info: Mapping[str, Any]) -> str | None:
    """The setting of a speculating server of `backend`: from its launch command (None: connected, then from
    what it reports, `info`); None where the backend has no such setting."""
    reader = READERS.get(backend)
    return None if reader is None else reader(command, info)
