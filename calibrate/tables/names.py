"""What a name a user writes means among the measured keys: a model, a speculator label, a thinking mode.

`show`, `export` and `report` filters and `lookup` resolve names alike. What matches nothing is `NotMeasured`
and what matches several is `AmbiguousMatch` (both LookupError: no answer, exit 1), each naming what was
measured instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations: InferenceX's naming imports `letters` without the store
    from calibrate.tables.query import CatalogEntry

_THINKING = {
    "on": "on", "thinking_on": "on", "true": "on", "1": "on", "yes": "on", "enabled": "on",
    "off": "off", "thinking_off": "off", "false": "off", "0": "off", "no": "off", "disabled": "off",
}


class NotMeasured(LookupError):
    """The table has no measurement for what was asked; the message names what it has."""


class AmbiguousMatch(LookupError):
    """More than one measured thing fits what was asked; the message lists them."""


def normalize_thinking(value: str) -> str:
    """'on' / 'off' from the spellings runners use (InferenceX's THINKING_MODE is thinking_on / thinking_off)."""
    try:
        return _THINKING[str(value).strip().lower()]
    except KeyError:
        raise ValueError(f"thinking mode {value!r} is not one of on / off (or thinking_on / thinking_off)") from None


def _last_part(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def letters(name: str) -> str:
    """Lowercased letters and digits only: 'GLM-5.2' and 'glm5.2' are both 'glm52'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _describe_targets(entries: Iterable[CatalogEntry]) -> str:
    names: dict[str, set[str]] = {}
    for e in entries:
        names.setdefault(e.target, set()).update(t for t in e.target_ids if t != e.target)
    return "; ".join(f"{t} ({', '.join(sorted(ids))})" if ids else t for t, ids in sorted(names.items()))


def match_target(model: str, entries: Sequence[CatalogEntry], *, prefix: bool = False,
                 aliases: Mapping[str, str] | None = None) -> str:
    """The stored target a user's model name means.

    Names match as users write them: the configured name or resolved id, whole (case-insensitive), else by
    last path part ('Qwen/Qwen2.5-Coder-1.5B-Instruct' and 'qwen2.5-coder-1.5b-instruct' are one model).
    `prefix` (for MODEL_PREFIX-style short names) then also accepts a last path part starting with the name,
    then one starting with it when punctuation is ignored, a name in `aliases` standing for the start it maps
    to (lookup passes InferenceX's MODEL_PREFIX codes: calibrate.consumers.lookup.MODEL_PREFIX_ALIASES):
    `glm5.2` finds `GLM-5.2-FP8`, `dsv4` finds `DeepSeek-V4-Pro`.
    The first rule that matches anything decides; several targets there is an error listing them.
    """
    wanted = model.strip().lower()
    rules = [
        lambda name: name.lower() == wanted,
        lambda name: _last_part(name) == _last_part(wanted),
    ]
    if prefix:
        short = letters((aliases or {}).get(_last_part(wanted), _last_part(wanted)))
        rules.append(lambda name: _last_part(name).startswith(_last_part(wanted)))
        rules.append(lambda name: bool(short) and letters(_last_part(name)).startswith(short))
    for rule in rules:
        hits = sorted({e.target for e in entries if any(rule(n) for n in (e.target, *e.target_ids))})
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise AmbiguousMatch(
                f"model {model!r} is ambiguous: it matches "
                + _describe_targets(e for e in entries if e.target in hits)
                + ". Give the full name."
            )
    available = _describe_targets(entries) or "none (the table is empty)"
    raise NotMeasured(f"no model matching {model!r} in the table; models: {available}")


def match_speculator(speculator: str, entries: Sequence[CatalogEntry]) -> str | None:
    """The stored speculator label a user's label means, or None.

    Whole label, case-insensitive; else same kind and the same last path part of what follows the kind
    ('draft:Qwen/Qwen2.5-Coder-0.5B-Instruct' is 'draft:/models/qwen2.5-coder-0.5b-instruct'); a bare kind
    ('draft') is the only label of that kind.
    """
    labels = sorted({e.speculator for e in entries})
    wanted = speculator.strip().lower()
    exact = [s for s in labels if s.lower() == wanted]
    if exact:
        return exact[0]
    kind, _, name = wanted.partition(":")
    hits = [
        s for s in labels
        if name and s.partition(":")[0].lower() == kind and _last_part(s.partition(":")[2]) == _last_part(name)
    ]
    if not name:  # a bare kind (a runner's recipe method: `draft`) means the one label of that kind
        hits = [s for s in labels if s.partition(":")[0].lower() == kind]
    if len(hits) > 1:
        raise AmbiguousMatch(f"speculator {speculator!r} is ambiguous: it matches {', '.join(hits)}")
    return hits[0] if hits else None
