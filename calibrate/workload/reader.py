"""Read a workload file: the CC-trace JSONL that AgentX replays, or a plain table of one request per row.

**CC traces** (`semianalysisai/cc-traces-weka-*`, built by InferenceX `infx/datasets/build_weka_hf_dataset.py`
from its proxy `infx/datasets/proxy_to_weka.py`): one trace per line, `{id, models, block_size,
hash_id_scope, [tool_tokens, system_tokens, totals], requests}`. An entry of `requests` is a request
`{t, type: "n" | "s", model, in, out, hash_ids, api_time, [think_time, ttft, input_types, output_types, stop]}`
or a subagent `{type: "subagent", t, agent_id, subagent_type, status, duration_ms, total_tokens,
tool_use_count, models, [tool_tokens, system_tokens], requests}` whose `requests` are its own, subagents
included. What each field means here, and how the format's readers treat it:

- `in`: the request's prompt tokens, its context stratum. In the proxy's corpus it is the count of 64-token
  hash blocks x 64, so it overcounts by up to one block (63 tokens); kv-cache-tester's published traces
  carry exact counts (`traces/trace_0022.json`: `in` 35,760). AIPerf reads it as the input length
  (`WekaNormalRequest.input_length`, alias `in`), kv-cache-tester as `input_tokens`, SGLang's replay as
  `RecordedTurn.prompt_tokens`; none corrects it, nor do we (the buckets are powers of two, so only a prompt
  within 64 tokens above an edge moves).
- `out`: output tokens (AIPerf `output_length` -> the turn's max_tokens; kv-cache-tester `output_tokens`;
  SGLang `output_tokens`, replayed as the decode length). The first comes from the prefill, so a request
  decodes `out - 1` tokens with the speculator (`calibrate.workload.profile`).
- `type`: `n` (non-streaming) and `s` (streaming) are both requests, as AIPerf and kv-cache-tester replay
  them; SGLang's replay keeps only `s` in the main agent (`MAIN_AGENT_REQUEST_TYPE`), a choice of its driver,
  not of the format. `subagent` nests a request list, read recursively at any depth as kv-cache-tester's
  `flatten_requests` does (AIPerf's schema admits one level only). A missing `type` is a request, as in
  kv-cache-tester (`req.get('type', ...)`); any other value is an error.
- `output_types`: the kinds the response held (`thinking`, `text`, `tool_use`); `thinking` in it marks a
  request that thinks. AIPerf and kv-cache-tester keep it verbatim (default empty), SGLang's replay drops it.
- `input_types`: what the prompt's new part is (`text`, `tool_result`); kv-cache-tester shapes the synthetic
  message by it (`'tool_result' in input_types`), AIPerf keeps it. No stratum reads it: ignored.
- `stop`: the stop reason (`tool_use`, `end_turn`, or ""); AIPerf and kv-cache-tester keep it (AIPerf's
  default ""). Kept for `inspect`.
- `t` (seconds from the trace's start; a subagent's requests from the subagent's start, as kv-cache-tester's
  `flatten_requests` adds them), `api_time`, `think_time`, `ttft`: AIPerf turns them into delays (in ms),
  kv-cache-tester into its timing strategies, SGLang's closed-loop replay drops them. `model`, `hash_ids`,
  `block_size`, `hash_id_scope`, `tool_tokens`, `system_tokens`: cache and model structure. None moves the AL of
  a request of given context and output: ignored.
- Turn depth: a request's position among its own agent's requests (1 = first); a subagent counts its own.
- Unknown fields are ignored, as kv-cache-tester (`dict.get`) and SGLang's replay do; AIPerf's pydantic
  models forbid extras (`extra="forbid"`), which would refuse a newer drop's added field.

Sources read (SemiAnalysis / NVIDIA / SGLang, via the workplace's search index): AIPerf
`src/aiperf/dataset/loader/weka_trace_models.py` at 90f31d18c57a572640729b1070a01b1bf2c7c7e4 and its fixture
`tests/fixtures/weka_traces/one_subagent.json` at 433ff264b6f401fee881b5ff7fc3793fc34de683; kv-cache-tester
(callanjfox) `trace_replay_tester.py` (`normalize_request`, `flatten_requests`), `docs/trace_replay_tester.md`
and `traces/trace_0022.json` at 94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf; SGLang
`python/sglang/test/agentic_trace_utils.py` at 1d7f9d7c196b65102cb6c73a9e0e7a595bedbb50 (`conversation_turns`,
`iter_weka_records`, which skips blank lines; its test quotes the corpus's first trajectory, 640 -> 63,744 ->
65,408 -> 66,880 prompt tokens with 20, 395, 265, 257 output tokens).

**Plain tables** for any other benchmark: CSV with a header, or JSONL, one request per row: `context_tokens`,
`output_tokens`, optional `turn` (1 = first) and `thinking` (true / false, 1 / 0, yes / no, on / off).

A file is read line by line (a 2 GB corpus in bounded memory: one trace at a time); a `.json` file that is
not one object per line is read whole as one trace or a list of them (AIPerf's and kv-cache-tester's one
trace per file). Every problem is a `WorkloadError` naming `file:line` and the field.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUEST_TYPES = ("n", "s")
SUBAGENT = "subagent"
THINKING = "thinking"
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


class WorkloadError(ValueError):
    """A workload file that cannot be read: one line naming file:line and the field (exit 2)."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload, as its strata see it."""

    context_tokens: int  # the prompt's tokens (`in`)
    output_tokens: int  # `out`
    turn: int | None  # its position among its agent's requests (1 = first); None where the file gives none
    thinking: bool | None  # whether it thinks; None where the file does not say
    agent_depth: int = 0  # 0 the main agent, 1 a subagent, 2 a subagent's subagent ...
    output_types: tuple[str, ...] = ()
    stop: str | None = None
    kind: str = "row"  # `n` / `s` for a trace's request, `row` for a plain table's
    trace: int | None = None  # which trace of the file it belongs to (1 = the first); None in a plain table


class WorkloadFile:
    """A workload file read once, in order: iterate for its requests; `digest` (sha256 of its bytes) and
    `traces` are known once the iteration is done. `progress` hears the bytes read as they are read."""

    def __init__(self, path: str | Path, progress: Callable[[int], None] | None = None):
        self.path = Path(path)
        self.progress = progress
        self.digest: str | None = None
        self.traces = 0
        if not self.path.exists():
            raise FileNotFoundError(f"no workload file at {self.path}")
        if self.path.is_dir():
            raise WorkloadError(f"{self.path} is a directory, not a workload file (.jsonl, .json or .csv)")
        if self.path.suffix.lower() not in (".jsonl", ".json", ".csv"):
            raise WorkloadError(f"{self.path}: a workload is a .jsonl / .json file of CC traces or request rows, "
                                "or a .csv of request rows")

    def __iter__(self) -> Iterator[WorkloadRequest]:
        self.traces = 0
        sha = hashlib.sha256()
        lines = _text_lines(self.path, sha, self.progress)
        count = 0
        rows = _csv_rows(self.path, lines) if self.path.suffix.lower() == ".csv" else self._json_records(lines)
        for request in rows:
            count += 1
            yield request
        if count == 0:
            raise WorkloadError(f"{self.path}:1: empty workload: no request in it")
        self.digest = f"sha256:{sha.hexdigest()}"

    def _json_records(self, lines: Iterator[tuple[int, str]]) -> Iterator[WorkloadRequest]:
        """One JSON value per line; a `.json` file whose first line is no whole value is read as one document."""
        for number, line in lines:
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                if number == _first_line(self.path) and self.path.suffix.lower() == ".json":
                    yield from self._document(line + "".join(text for _, text in lines))
                    return
                raise WorkloadError(f"{self.path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
            yield from self._record(value, f"{self.path}:{number}")

    def _document(self, text: str) -> Iterator[WorkloadRequest]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{self.path}:{exc.lineno}: not JSON ({exc.msg} at column {exc.colno})") from None
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            yield from self._record(item, f"{self.path} (document{f' item {i}' if isinstance(value, list) else ''})")

    def _record(self, value: Any, where: str) -> Iterator[WorkloadRequest]:
        if not isinstance(value, dict):
            raise WorkloadError(f"{where}: a {type(value).__name__}, not a trace or a request row (a JSON object)")
        if "requests" in value:
            self.traces += 1
            yield from _agent(value["requests"], where, "", 0, self.traces)
        elif "context_tokens" in value:
            yield _row(value, where)
        else:
            raise WorkloadError(f"{where}: neither a trace (no field requests) nor a request row "
                                "(no field context_tokens)")


def _first_line(path: Path) -> int:
    """The number of the file's first non-blank line (where a pretty-printed document starts)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                return number
    return 1


def _text_lines(path: Path, sha: Any, progress: Callable[[int], None] | None) -> Iterator[tuple[int, str]]:
    """(line number, text) of the file in order, hashing its bytes and reporting them as they are read."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            sha.update(raw)
            if progress is not None:
                progress(len(raw))
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise WorkloadError(f"{path}:{number}: not UTF-8 text") from None


def _agent(entries: Any, where: str, path: str, depth: int, trace: int) -> Iterator[WorkloadRequest]:
    """An agent's requests in order, its subagents' (at any depth) where they sit."""
    if not isinstance(entries, list):
        raise WorkloadError(f"{where}: field {path}requests is a {type(entries).__name__}, not a list")
    turn = 0
    for i, entry in enumerate(entries):
        at = f"{path}requests[{i}]"
        if not isinstance(entry, dict):
            raise WorkloadError(f"{where}: field {at} is a {type(entry).__name__}, not an object")
        kind = entry.get("type")
        if kind == SUBAGENT:
            if "requests" not in entry:
                raise WorkloadError(f"{where}: field {at}.requests missing (a subagent lists its requests)")
            yield from _agent(entry["requests"], where, f"{at}.", depth + 1, trace)
            continue
        if kind is not None and kind not in REQUEST_TYPES:
            raise WorkloadError(f"{where}: field {at}.type {kind!r} is none of n, s, subagent")
        turn += 1
        types = _types(entry.get("output_types"), where, f"{at}.output_types")
        stop = entry.get("stop")
        if stop is not None and not isinstance(stop, str):
            raise WorkloadError(f"{where}: field {at}.stop is a {type(stop).__name__}, not text")
        yield WorkloadRequest(
            context_tokens=_count(entry, "in", where, at), output_tokens=_count(entry, "out", where, at),
            turn=turn, thinking=None if types is None else THINKING in types, agent_depth=depth,
            output_types=types or (), stop=stop, kind=kind or "s", trace=trace)


def _types(value: Any, where: str, field: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WorkloadError(f"{where}: field {field} is not a list of text")
    return tuple(value)


def _count(entry: dict[str, Any], name: str, where: str, at: str) -> int:
    """A token count: a JSON integer >= 0 (an integral number such as 64.0 reads as 64)."""
    field = f"{at}.{name}" if at else name
    if name not in entry:
        raise WorkloadError(f"{where}: field {field} missing")
    value = entry[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise WorkloadError(f"{where}: field {field} {value!r} is not a token count (an integer)")
    if value < 0:
        raise WorkloadError(f"{where}: field {field} {value!r} is negative")
    return int(value)


def _row(value: dict[str, Any], where: str) -> WorkloadRequest:
    """A plain JSONL request row."""
    turn = value.get("turn")
    if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or turn < 1):
        raise WorkloadError(f"{where}: field turn {turn!r} is not a turn number (1 = the first)")
    return WorkloadRequest(context_tokens=_count(value, "context_tokens", where, ""),
                           output_tokens=_count(value, "output_tokens", where, ""), turn=turn,
                           thinking=_flag(value.get("thinking"), where))


def _flag(value: Any, where: str) -> bool | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise WorkloadError(f"{where}: field thinking {value!r} is none of true / false, 1 / 0, yes / no, on / off")


def _csv_rows(path: Path, lines: Iterator[tuple[int, str]]) -> Iterator[WorkloadRequest]:
    """A CSV with a header naming at least context_tokens and output_tokens; other columns are ignored."""
    reader = csv.DictReader(text for _, text in lines)
    header = reader.fieldnames
    if header is None:
        return
    missing = [c for c in ("context_tokens", "output_tokens") if c not in header]
    if missing:
        raise WorkloadError(f"{path}:1: no column {', '.join(missing)} (columns: {', '.join(header)})")
    for row in reader:
        where = f"{path}:{reader.line_num}"
        parsed: dict[str, Any] = {}
        for name in ("context_tokens", "output_tokens", "turn"):
            text = (row.get(name) or "").strip()
            if not text:
                if name != "turn":
                    raise WorkloadError(f"{where}: field {name} missing")
                continue
            try:
                parsed[name] = int(text)
            except ValueError:
                raise WorkloadError(f"{where}: field {name} {text!r} is not an integer") from None
        if "thinking" in header:
            parsed["thinking"] = (row.get("thinking") or "").strip()
        yield _row(parsed, where)
