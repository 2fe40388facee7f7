"""InferenceX's reference AL file: `benchmarks/speedbench-reference-al.yaml`, one block per model key.

A second InferenceX loader (SemiAnalysisAI/InferenceX `infx/recipes/synthetic_acceptance.py` at
18385430d628a4e35795a2f6278fc7fc241df79e, `resolve_acceptance_length`) reads no golden curve per recipe method:
it opens one YAML, takes the top-level key `MODEL_KEYS.get(MODEL_PREFIX, MODEL_PREFIX)`, merges a block given
as a list of one-item mappings, picks `THINKING_MODE` (default thinking_on) when a key of the block starts with
"thinking", then the int k (NUM_SPEC_TOKENS, else the recipe's, else 2), and refuses a value that is not finite
or below 1. Our restatement of those rules, our way; the file is shared by every model, so an export into an
existing file replaces our key's values only and leaves every other line as it was.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence

import yaml

from calibrate.consumers.inferencex import (KNOWN_TARGETS, MODEL_KEYS, NO_THINKING_ON, _same_model, known_prefix,
                                         sampling)
from calibrate.tables.records import LENGTH_DIGITS, SEGMENT_ALL, AcceptanceRecord, workload_lines

REFERENCE_FILE = "benchmarks/speedbench-reference-al.yaml"
MODES = ("thinking_on", "thinking_off")
_PLAIN = re.compile(r"[a-z][a-z0-9_.-]*")
_YAML_WORDS = frozenset({"yes", "no", "on", "off", "true", "false", "null", "y", "n"})


def model_key(prefix: str) -> str:
    """The key the loader looks up for MODEL_PREFIX `prefix`; a prefix it could not resolve is a ValueError."""
    if not prefix or prefix != prefix.strip() or any(not c.isprintable() for c in prefix):
        raise ValueError(f"InferenceX cannot resolve MODEL_PREFIX {prefix!r}: it reads the variable unstripped and "
                         "looks up MODEL_KEYS.get(MODEL_PREFIX, MODEL_PREFIX); give a non-empty --model-prefix "
                         "without spaces")
    return MODEL_KEYS.get(prefix, prefix)


def prefixes_of(key: str, chosen: str) -> list[str]:
    """The runner MODEL_PREFIX values that resolve to `key`: MODEL_KEYS' codes for it, and the one chosen."""
    return sorted({chosen, *(p for p, k in MODEL_KEYS.items() if k == key)})


def _yaml_key(key: str) -> str:
    """A top-level key unquoted where YAML reads it back as that string, else JSON-quoted (valid YAML)."""
    return key if _PLAIN.fullmatch(key) and key not in _YAML_WORDS else json.dumps(key)


class _Ours(str):
    """An AL we measured, as its 2-decimal text (written unquoted: YAML reads a float)."""


def _scalar(value: object) -> str:
    """A value written so YAML reads it back as it was: ours as measured text, a kept one unchanged."""
    if isinstance(value, _Ours):
        return str(value)
    return repr(value) if isinstance(value, float) else json.dumps(value)


def cells(records: Sequence[AcceptanceRecord], prefix: str | None) -> tuple[str, str, dict[str, dict[int, str]]]:
    """(MODEL_PREFIX, key, {thinking_on/off: {k: AL text}}) for one model's overall records; several models,
    speculators or populations under one key, or an AL the loader would refuse, are a ValueError."""
    rows = [r for r in records if r.segment == SEGMENT_ALL]
    if not rows:
        raise ValueError("no overall records to export")
    prefixes = {prefix or known_prefix(r.target) for r in rows}
    if None in prefixes:
        known = ", ".join(f"{start}* -> {p}" for start, p in KNOWN_TARGETS)
        raise ValueError(f"--model-prefix is required: InferenceX keys {REFERENCE_FILE} by the runner's MODEL_PREFIX, "
                         f"and {rows[0].target} is no known target ({known})")
    keys = {model_key(p): p for p in prefixes}  # type: ignore[arg-type]
    pairs = sorted({(r.target, r.speculator) for r in rows})
    if len(keys) > 1 or (len(pairs) > 1 and not (len({s for _, s in pairs}) == 1 and _same_model(rows))):
        listed = "; ".join(f"{t} with {s}" for t, s in pairs)
        raise ValueError(f"{REFERENCE_FILE} holds one curve per model key, and these records are several ({listed}): "
                         "filter with --model / --speculator")
    populations = sorted({(r.dataset, sampling(r)) for r in rows})
    if len(populations) > 1:
        listed = "; ".join(f"dataset={d} {s}" for d, s in populations)
        raise ValueError(f"several datasets / samplings ({listed}); a reference block holds one: filter with "
                         "--dataset / --temperature")
    ((key, chosen),) = keys.items()
    out: dict[str, dict[int, str]] = {}
    for r in rows:
        value = _Ours(r.value())
        if not (math.isfinite(float(value)) and 1 <= float(value) <= r.k + 1):
            raise ValueError(f"{r.target} k={r.k}: AL {value} is outside [1, k + 1]")
        other = out.setdefault(f"thinking_{r.thinking}", {}).setdefault(r.k, value)
        if other != value:
            raise ValueError(f"thinking_{r.thinking}, k={r.k} was measured twice (AL {other} and {value}): "
                             "filter with --model")
    return chosen, key, out


def header(records: Sequence[AcceptanceRecord], tool: str, basis: str) -> list[str]:
    """Our comment lines, indented under the key so a later merge replaces them with the values; `basis` says
    which steps the AL is a mean over (the consumer registry's)."""
    rows = [r for r in records if r.segment == SEGMENT_ALL]
    dataset, how = rows[0].dataset, sampling(rows[0])
    return [f"  # {', '.join(sorted({r.target for r in rows}))} with speculator {rows[0].speculator}; dataset "
            f"{dataset}; {how}",
            *(f"  # requests: {name} only (calibrate.tables.buckets)" for name in sorted({r.bucket for r in rows
                                                                                       if r.bucket})),
            *(f"  # {line}" for line in workload_lines(sorted(rows, key=lambda r: (r.thinking, r.k)))),
            f"  # {basis}; {LENGTH_DIGITS} decimals; generated by {tool}"]


def render_block(key: str, block: Mapping[str, Mapping[int, object]], comments: Sequence[str]) -> str:
    """`key:` then thinking_on / thinking_off (then any other mode kept from the file), int k ascending."""
    lines = [f"{_yaml_key(key)}:", *comments]
    for mode in sorted(block, key=lambda m: (MODES.index(m) if m in MODES else len(MODES), str(m))):
        lines.append(f"  {_yaml_key(str(mode))}:")
        lines.extend(f"    {k}: {_scalar(v)}" for k, v in sorted(block[mode].items()))
    return "\n".join(lines) + "\n"


def document(records: Sequence[AcceptanceRecord], prefix: str | None, tool: str, basis: str) -> str:
    """A new reference file holding our key only."""
    _, key, block = cells(records, prefix)
    return ("# Acceptance length (AL) reference values, read by InferenceX infx/recipes/synthetic_acceptance.py\n"
            "# key = MODEL_KEYS.get(MODEL_PREFIX, MODEL_PREFIX), then THINKING_MODE, then num_speculative_tokens\n"
            + render_block(key, block, header(records, tool, basis)))


def _mapping(value: object) -> dict[object, object] | None:
    """A mapping as the loader reads it: a dict, or a list of one-item mappings merged into one (None, an empty
    entry, is empty); anything else is None."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return {level: al for item in value for level, al in item.items()}
    return None


def _held(value: object) -> str:
    text = repr(value)
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({text if len(text) <= 40 else text[:37] + '...'})"


def existing_block(value: object, key: str) -> dict[str, dict[int, object]]:
    """Our key's block as the file holds it, {mode: {k: AL}}; a block the loader cannot read that way is a
    ValueError saying why (replacing it needs --force)."""
    modes = _mapping(value)
    if modes is None:
        raise ValueError(f"{key} is {_held(value)}, not a mapping of thinking modes")
    if modes and not any(str(m).startswith("thinking") for m in modes):
        raise ValueError(f"{key} holds k values without thinking modes ({', '.join(map(str, modes))}); thinking "
                         "blocks would hide them from InferenceX")
    block: dict[str, dict[int, object]] = {}
    for mode, values in modes.items():
        ks = _mapping(values)
        if ks is None:
            raise ValueError(f"{key}: {mode} is {_held(values)}, not a mapping of k to AL")
        bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, int)]
        if bad:
            raise ValueError(f"{key}: {mode} has k {', '.join(map(repr, bad))}, not an integer (InferenceX looks up "
                             "an int k)")
        block[str(mode)] = ks  # type: ignore[assignment]
    return block


def merge(existing: str, records: Sequence[AcceptanceRecord], prefix: str | None, tool: str, force: bool,
          where: str, tell: Callable[[str], None], basis: str) -> str:
    """`existing` (a reference file's text) with our key's values added or replaced; every other key's lines are
    kept as they are. Replacing a (key, thinking, k) value that differs, or a block the loader cannot read as
    thinking modes of int k (existing_block), needs `force`, and `tell` is told what was replaced; a file we
    cannot splice safely is refused. The result is checked by parsing it back."""
    _, key, new = cells(records, prefix)
    try:
        old = yaml.safe_load(existing) if existing.strip() else {}
        root = yaml.compose(existing) if existing.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not YAML ({str(exc).splitlines()[0]}); nothing written") from None
    if old is None:
        old = {}
    if not isinstance(old, dict) or (root is not None and (not isinstance(root, yaml.MappingNode) or root.flow_style)):
        raise ValueError(f"{where}: not a block mapping of model keys; nothing written")
    spots = [n for n, _ in (root.value if root is not None else []) if n.value == key]
    if len(spots) > 1:
        raise ValueError(f"{where}: key {key} appears {len(spots)} times; nothing written")
    block: dict[str, dict[int, object]] = {}
    try:
        block = existing_block(old.get(key), key)
    except ValueError as exc:
        if not force:
            raise ValueError(f"{where}: {exc}: pass --force to replace {key}'s block") from None
        tell(f"{where}: replaced {key}'s block ({exc})")
    replaced = [f"({key}, {mode}, k={k}) = {block[mode][k]} -> {v}" for mode, ks in new.items() for k, v in ks.items()
                if k in block.get(mode, {}) and not _same(block[mode][k], v)]
    if replaced and not force:
        raise ValueError(f"{where}: would replace {'; '.join(replaced)}: pass --force to replace")
    if replaced:
        tell(f"{where}: replaced {'; '.join(replaced)}")
    for mode, ks in new.items():
        block.setdefault(mode, {}).update(ks)
    text = render_block(key, block, header(records, tool, basis))
    lines = existing.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    if spots:
        start = spots[0].start_mark.line
        later = [n.start_mark.line for n, _ in root.value if n.start_mark.line > start]  # type: ignore[union-attr]
        end = min(later) if later else len(lines)
        while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
            end -= 1  # comments at column 0 above the next key are that key's
        merged = "".join(lines[:start]) + text + "".join(lines[end:])
    else:
        merged = "".join(lines) + text
    expected = {**old, key: {m: {k: float(v) if isinstance(v, _Ours) else v for k, v in ks.items()}
                             for m, ks in block.items()}}
    try:
        spliced = yaml.safe_load(merged)
    except yaml.YAMLError:  # e.g. another key aliased an anchor inside our old block
        spliced = None
    if spliced != expected:
        raise ValueError(f"{where}: cannot splice {key} into this file without changing another key; nothing written")
    return merged


def _same(old: object, new: str) -> bool:
    try:
        return float(old) == float(new)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def notes(records: Sequence[AcceptanceRecord], prefix: str | None) -> list[str]:
    """Which key / thinking mode / k InferenceX reads for which MODEL_PREFIX."""
    chosen, key, block = cells(records, prefix)
    runners = " or ".join(f"MODEL_PREFIX={p}" for p in prefixes_of(key, chosen))
    return [f"InferenceX synthetic_acceptance.py reads {REFERENCE_FILE} key {key}, {mode} "
            f"k in {{{', '.join(str(k) for k in sorted(ks))}}} for {runners}"
            f"{' (THINKING_MODE unset or ' + mode + ')' if mode == 'thinking_on' else ' (THINKING_MODE=' + mode + ')'}"
            for mode, ks in sorted(block.items(), key=lambda kv: MODES.index(kv[0]))]


def warnings(records: Sequence[AcceptanceRecord], prefix: str | None) -> list[str]:
    """A block without thinking_on fails every InferenceX run that does not set thinking_off (NO_THINKING_ON)."""
    _, key, block = cells(records, prefix)
    if "thinking_on" in block:
        return []
    return [f"{key} has no thinking_on values (unless the file already holds them for it): {NO_THINKING_ON}"]
