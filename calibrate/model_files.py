"""Reading a model's files without its weights: where a name lives (a local folder or file, a built test model,
the hub, or the hub's cache when it is unreachable), its tokenizer and config, and the refusal of code a model
folder would run. Torch-free, so what needs only these (`calibrate run --plan`, the checks before any weights
load) never pays for torch; calibrate.models loads the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from calibrate.hub import hub_reachable
from calibrate.model_names import built_models_dir, check_written_path, resolve


def hub_access(name: str, where: str) -> dict[str, Any]:
    """from_pretrained kwargs for a name that is not local: none when the hub answers, else cache only.

    A name written as a path that does not exist fails at once, and an unreachable hub is asked nothing
    (huggingface_hub would retry for about 50 s): only its local cache is looked in.
    """
    check_written_path(name)
    if where != name or Path(where).exists():
        return {}
    return {} if hub_reachable() else {"local_files_only": True}


def _not_found(name: str, where: str, access: dict[str, Any], what: str, exc: Exception) -> ValueError:
    if where != name or Path(where).exists():
        return ValueError(f"model {name!r}: cannot load {what} from {where!r}: {type(exc).__name__}: {exc}")
    hub = ("the Hugging Face hub is unreachable (offline) and its local cache lacks it"
           if access.get("local_files_only") else "the Hugging Face hub has no such model (or refused access)")
    return ValueError(f"model {name!r}: not a path, not a built test model in {built_models_dir()}, and {hub}")


def refuse_plain_file(name: str, model_id: str) -> None:
    """A model path that is a file but not a .gguf (a config.json, a .safetensors) is named as such; the
    loader would take it for a hub repo id and say so, which misleads. A folder's JSON files must be JSON
    objects: transformers ends in a TypeError traceback on `null` or a list."""
    path = Path(model_id)
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model {name!r}: {model_id} is a file, not a model folder or a .gguf file: give the "
                         "folder that holds its config.json")
    for file in (path / "config.json", path / "tokenizer_config.json"):
        if file.is_file():
            _check_json_object(file, name)


def _check_json_object(file: Path, name: str) -> None:
    import json

    try:
        value = json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"model {name!r}: {file} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"model {name!r}: {file} holds a JSON {type(value).__name__}, not an object")


def _local_load_failure(exc: Exception, model_id: str) -> bool:
    """Whether a loader's exception is the input's fault: any failure on a local folder or file is (a
    config whose values break transformers, weights of other shapes); elsewhere only OSError / ValueError."""
    return isinstance(exc, (OSError, ValueError)) or Path(model_id).exists()


def _split_gguf(model_id: str) -> tuple[str, dict[str, str]]:
    """transformers loads a GGUF file as (its folder, gguf_file=name)."""
    path = Path(model_id)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return model_id, {}


def _model_json(model_id: str, file: str, access: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(where, contents) of a small JSON file of a model folder or hub repo; None where there is none to read
    (a .gguf file, a missing or unreadable file: the loader itself says what is wrong with those)."""
    path = Path(model_id)
    if path.suffix == ".gguf":
        return None
    try:
        if path.is_dir():
            found = path / file if (path / file).is_file() else None
        else:
            from transformers.utils import cached_file

            found = cached_file(model_id, file, _raise_exceptions_for_missing_entries=False, **access)
        value = json.loads(Path(found).read_bytes()) if found else None
    except Exception:  # a hub that does not answer, a file that is not JSON: left to the loader's own message
        return None
    return (str(found), value) if isinstance(value, dict) else None


def _auto_map(value: dict[str, Any]) -> dict[str, Any]:
    auto_map = value.get("auto_map")
    return auto_map if isinstance(auto_map, dict) else {}


def _code_names(entry: Any) -> str:
    """The classes an auto_map entry names (a "module.Class", or a [slow, fast] pair with nulls)."""
    return ", ".join(str(e) for e in (entry if isinstance(entry, list) else [entry]) if e)


def remote_code(model_id: str, access: dict[str, Any]) -> list[str]:
    """What of a model would only load by running its own Python: its config.json's `auto_map` where
    transformers ships no class for its `model_type`, and an `auto_map` AutoTokenizer entry (tokenizer_config.json
    or config.json) where its `tokenizer_class` is not one transformers ships (transformers would load another
    tokenizer in its place, which may not tokenize as the model's own does). Empty: nothing."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config = _model_json(model_id, "config.json", access)
    tok_config = _model_json(model_id, "tokenizer_config.json", access)
    found = []
    if config is not None and _auto_map(config[1]) and config[1].get("model_type") not in CONFIG_MAPPING:
        found.append(f"{config[0]} (auto_map {', '.join(_code_names(e) for e in _auto_map(config[1]).values())})")
    tokenizer_class = tok_config[1].get("tokenizer_class") if tok_config is not None else None
    shipped = isinstance(tokenizer_class, str) and tokenizer_class_from_name(tokenizer_class) is not None
    for where, value in (j for j in (tok_config, config) if j is not None):
        entry = _auto_map(value).get("AutoTokenizer")
        if entry and not shipped:
            found.append(f"{where} (auto_map AutoTokenizer {_code_names(entry)})")
            break
    return found


def remote_code_refusal(name: str, found: list[str]) -> ValueError:
    """The one line for a model or tokenizer that needs remote code (`found`: what names it)."""
    return ValueError(f"model {name!r} needs remote code: {'; '.join(found)} names Python code of its own, and "
                      "calibrate never runs a model's code (trust_remote_code=False); use a checkpoint of an "
                      "architecture transformers ships")


def load_pretrained(loader: Any, name: str, model_id: str, what: str, **kwargs: Any) -> Any:
    """`loader.from_pretrained` (AutoTokenizer, AutoConfig, AutoModelForCausalLM) of a resolved name, never
    running a model's own code nor asking on stdin whether to (trust_remote_code=False; transformers' default
    asks, and a `y` piped in ran it); a model that needs such code, and a failure on a local folder or file,
    are one ValueError naming it."""
    access = hub_access(name, model_id)
    found = remote_code(model_id, access)
    if found:
        raise remote_code_refusal(name, found)
    where, extra = _split_gguf(model_id)
    try:
        return loader.from_pretrained(where, **extra, **access, **kwargs, trust_remote_code=False)
    except Exception as exc:
        if not _local_load_failure(exc, model_id):
            raise
        if "trust_remote_code" in str(exc):  # transformers' own refusal, for what `remote_code` did not see
            raise remote_code_refusal(name, [f"{model_id} (its auto_map)"]) from None
        raise _not_found(name, model_id, access, what, exc) from None


def load_tokenizer(name: str) -> Any:
    """The tokenizer (and chat template) alone: cheap, so configs can be checked before weights load."""
    from transformers import AutoTokenizer

    model_id = resolve(name)
    refuse_plain_file(name, model_id)
    return load_pretrained(AutoTokenizer, name, model_id, "its tokenizer")


def model_config(name: str) -> Any:
    """The model's transformers config alone (no weights, no code of its own run)."""
    from transformers import AutoConfig

    model_id = resolve(name)
    refuse_plain_file(name, model_id)
    return load_pretrained(AutoConfig, name, model_id, "its config")


def check_same_tokenizer(target_name: str, target_tok: Any, draft_name: str, draft_tok: Any) -> None:
    """A draft must speak the target's tokens: token ids are compared directly during verification."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        t, d = target_tok.get_vocab(), draft_tok.get_vocab()
        only_t = len(set(t.items()) - set(d.items()))
        only_d = len(set(d.items()) - set(t.items()))
        raise ValueError(
            f"draft {draft_name!r} has a different tokenizer from target {target_name!r} "
            f"({len(d)} vs {len(t)} tokens; {only_t} target and {only_d} draft entries differ): a draft model "
            "must share the target's vocabulary"
        )
