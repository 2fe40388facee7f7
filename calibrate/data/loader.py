"""`open_conversations` / `load_conversations`: resolve a source, pick the adapter, and stream (or collect)
conversations and problems.

Bad rows never raise: each becomes a `Problem` (source, row, field, reason) and loading goes on. Only an
unusable source itself (a path that does not exist, a dataset that cannot be opened, an unknown format
name) raises, with a message that names it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from calibrate.data.bounds import TOO_DEEP, message_problem
from calibrate.data.conversation import Conversation, LoadResult, Problem
from calibrate.data.formats import ADAPTERS, RowError, canonical_format, detect_format, dropped_fields, row_id
from calibrate.data.manifests import DatasetEntry, find_manifest_entry
from calibrate.hub import hub_reachable, looks_like_path
from calibrate.data.sources import HUB_PREFIX, RawRow, folder_files, iter_file_rows, iter_hub_rows

DETECT_ROWS = 8  # rows looked at to detect a file's format

RowGroup = tuple[str, Iterable[RawRow]]  # (file path or dataset id, its rows): one format per group


class ConversationStream:
    """The conversations of a source, parsed one at a time as it is iterated (once).

    Nothing but the conversation being parsed is held, so a source of any size can be walked; `problems`
    and `format` fill in as the rows go by and are complete once the iteration ends. What stays is the set
    of conversation ids read so far (ids are made unique, which needs it) and the problems.
    """

    def __init__(self, groups: Iterable[RowGroup], fmt: str | None, limit: int | None,
                 category: str | None = None) -> None:
        self._groups, self._fmt, self._limit, self._category = groups, fmt, limit, category
        self._started = False
        self.problems: list[Problem] = []
        self.formats: list[str] = []  # formats met, in order
        self.count = 0  # conversations yielded so far
        self.other_category = 0  # readable rows left out because their `category` is not the one asked for

    @property
    def category(self) -> str | None:
        """The category kept (asked for, or a manifest entry's), or None when every row is read."""
        return self._category

    @property
    def format(self) -> str:
        """The formats read, comma-separated (the named format when nothing was read)."""
        return ", ".join(self.formats) if self.formats or self._limit != 0 else (self._fmt or "")

    def __iter__(self) -> Iterator[Conversation]:
        if self._started:
            raise RuntimeError("a ConversationStream is read once; open the source again")
        self._started = True
        if self._limit == 0:
            return
        seen_ids: set[str] = set()
        for group_source, rows in self._groups:
            group_fmt, group_rows = self._group_format(group_source, rows)
            if group_fmt is None:
                continue
            for raw in group_rows:
                if self._category is not None and raw.data is not None and raw.data.get("category") != self._category:
                    self.other_category += 1  # another category's row: left out, not a problem
                    continue
                if self._fmt is not None and raw.data is not None and (detected := _detect([raw])) != self._fmt:
                    _refuse_dropping(raw, self._fmt, detected)  # a named format must not drop what the data holds
                conv = convert_row(raw, group_fmt, self.problems, seen_ids)
                if conv is None:
                    continue
                self.count += 1
                yield conv
                if self._limit is not None and self.count >= self._limit:
                    return

    def _group_format(self, group_source: str, rows: Iterable[RawRow]) -> tuple[str | None, Iterator[RawRow]]:
        """The group's format (named, or detected from its first rows) and its rows, none consumed."""
        group_rows: Iterator[RawRow] = iter(rows)
        group_fmt = self._fmt
        if group_fmt is None:
            head = list(itertools.islice(group_rows, DETECT_ROWS))
            group_fmt = _detect(head)
            group_rows = itertools.chain(head, group_rows)
            if group_fmt is None:
                self.problems.append(Problem(group_source, _undetected_reason(head)))
                return None, group_rows
        if group_fmt not in self.formats:
            self.formats.append(group_fmt)
        return group_fmt, group_rows


@dataclass(frozen=True)
class SourceSpec:
    """Where conversations come from and which of them to read: the source half of a run's `[dataset]`
    table (calibrate.config.DatasetConfig.source_spec), or a command's options.

    `source` is a file (.json, .jsonl, .parquet), a folder of them, a name from calibrate/data/datasets.toml
    (looked up in `manifest`, default that file), or a Hugging Face dataset id (org/name; `split`,
    `revision`, `subset` apply; streamed). A `hf:` prefix sends a path through `datasets.load_dataset` even
    when it is local (a folder in the hub's layout). `format` names the adapter (or an alias); otherwise it
    is detected per file. `limit` caps the conversations read. `category` (or a manifest entry's) keeps only
    the rows whose `category` field is that value (SPEED-Bench and Spec-Bench rows carry one: `coding`,
    `math`, ...)."""

    source: str
    format: str | None = None
    split: str | None = None
    revision: str | None = None
    subset: str | None = None
    limit: int | None = None
    manifest: str | Path | None = None
    category: str | None = None


def as_spec(spec: SourceSpec | str) -> SourceSpec:
    """A bare string is the source alone, every other setting left out."""
    return SourceSpec(spec) if isinstance(spec, str) else spec


def open_conversations(spec: SourceSpec | str) -> ConversationStream:
    """Open a source for streaming. The source is resolved now (a missing path or unknown format raises here; a hub dataset that cannot be opened
    raises when reading starts), rows are read only as the returned stream is iterated, and reading stops
    as soon as `limit` is reached. A `.json` file is parsed whole (one row or a list of rows); JSONL,
    Parquet and hub datasets are read row by row.
    """
    spec = as_spec(spec)
    if spec.limit is not None and spec.limit < 0:
        raise ValueError(f"limit must be >= 0, got {spec.limit}")
    fmt = canonical_format(spec.format) if spec.format else None
    groups, entry = _resolve(spec)
    category = spec.category
    if entry is not None and category is not None and entry.category not in (None, category):
        raise ValueError(f"dataset {spec.source!r} is the {entry.category!r} category of {entry.hf_id} "
                         f"(calibrate/data/datasets.toml), not {category!r}: name the hub id with category instead")
    return ConversationStream(groups, fmt or (entry.format if entry else None), spec.limit,
                              category or (entry.category if entry else None))


def load_conversations(spec: SourceSpec | str) -> LoadResult:
    """Every conversation of a source in a list (as `open_conversations` reads it).

    For sources that fit in memory; a run selects from a stream instead (`calibrate.data.stream`).
    """
    stream = open_conversations(spec)
    conversations = list(stream)
    return LoadResult(conversations=conversations, problems=stream.problems, format=stream.format)


def _refuse_dropping(raw: RawRow, fmt: str, detected: str | None) -> None:
    """A format named for data it cannot fully read is refused, naming what it would drop."""
    dropped = dropped_fields(raw.data or {}, fmt)
    if dropped:
        hint = f"the data looks like {detected!r}: name that format or leave `format` out" if detected else \
            "leave `format` out to detect it"
        raise ValueError(f"{raw.source} row {raw.row}: format {fmt!r} cannot carry field "
                         f"{' and '.join(repr(f) for f in dropped)} of this data, which it would drop; {hint}")


def unicode_problem(conv: Conversation) -> tuple[str, str] | None:
    """(field, reason) for text that is not valid Unicode (a lone surrogate such as "\\ud83d", valid JSON
    but no character): no tokenizer can encode it, so such a row is a problem, not a crash."""
    def bad(text: str | None) -> bool:
        if not text:
            return False
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    for i, m in enumerate(conv.messages):
        for name, text in (("content", m.content), ("reasoning", m.reasoning), ("name", m.name),
                           ("tool_call_id", m.tool_call_id),
                           ("tool_calls", json.dumps([c.to_openai() for c in m.tool_calls], ensure_ascii=False))):
            if bad(text):
                return f"messages[{i}].{name}", "text holds a lone surrogate (not valid Unicode; no tokenizer encodes it)"
    if bad(json.dumps(list(conv.tools), ensure_ascii=False, default=str)):
        return "tools", "tool schemas hold a lone surrogate (not valid Unicode)"
    if bad(conv.id):
        return "id", "the row id holds a lone surrogate (not valid Unicode)"
    return None


def unique_id(raw: RawRow, seen_ids: set[str]) -> str:
    """The row's own id, or `<file stem>:<row>` when it has none; one already taken gets `@<file stem>:<row>`
    after it, and should that be taken too (a row may carry such an id itself), `.2`, `.3`, ... after that.
    Ids that never collided stay as they always were, so their stored requests are found again."""
    where = f"{Path(raw.source).stem}:{raw.row}"
    conv_id = row_id(raw.data) or where
    if conv_id not in seen_ids:
        return conv_id
    base = candidate = f"{conv_id}@{where}"
    n = 1
    while candidate in seen_ids:
        n += 1
        candidate = f"{base}.{n}"
    return candidate


def convert_row(raw: RawRow, fmt: str, problems: list[Problem], seen_ids: set[str]) -> Conversation | None:
    """Adapt one raw row; on failure append its `Problem` and return None. Ids are made unique (`unique_id`)."""
    if raw.problem is not None or raw.data is None:
        problems.append(raw.problem or Problem(raw.source, "unreadable row", row=raw.row))
        return None
    conv_id = unique_id(raw, seen_ids)
    try:
        conv = ADAPTERS[fmt](raw.data, conv_id, f"{raw.source}#{raw.row}")
    except RowError as exc:
        problems.append(Problem(raw.source, exc.reason, row=raw.row, field=exc.field))
        return None
    except RecursionError:  # JSON text inside the row (tool-call arguments) nested past the interpreter's stack
        problems.append(Problem(raw.source, f"JSON {TOO_DEEP}", row=raw.row))
        return None
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # Safety net so one odd row cannot stop a run; adapters are meant to raise RowError only (a
        # property test checks that on random JSON), so this names the exception to make a bug visible.
        problems.append(Problem(raw.source, f"adapter error {type(exc).__name__}: {exc}", row=raw.row))
        return None
    bad = message_problem(conv) or unicode_problem(conv)
    if bad is not None:
        problems.append(Problem(raw.source, bad[1], row=raw.row, field=bad[0]))
        return None
    seen_ids.add(conv_id)
    return conv


def _detect(head: list[RawRow]) -> str | None:
    for raw in head:
        if raw.data is not None:
            found = detect_format(raw.data)
            if found is not None:
                return found
    return None


def _undetected_reason(head: list[RawRow]) -> str:
    readable = [r.data for r in head if r.data is not None]
    if not readable:
        problems = [str(r.problem.reason) for r in head if r.problem is not None]
        return "no readable rows" + (f" ({problems[0]})" if problems else "")
    keys = sorted({k for row in readable for k in row})[:12]
    return f"no known conversation format (row keys: {', '.join(map(str, keys))})"


def _resolve(spec: SourceSpec) -> tuple[list[RowGroup] | Iterator[RowGroup], DatasetEntry | None]:
    """Turn a source into row groups (one per file, or one for a hub dataset) and the manifest entry it
    names (its format and category apply), if any."""
    source, split, revision, subset = spec.source, spec.split, spec.revision, spec.subset
    if source.startswith(HUB_PREFIX):
        dataset_id = source[len(HUB_PREFIX):]
        return [_hub_group(dataset_id, split, revision, subset)], None
    path = Path(source).expanduser()
    if path.is_file():
        return [(str(path), iter_file_rows(path))], None
    if path.is_dir():
        files = folder_files(path)
        if not files:
            raise FileNotFoundError(f"{path}: folder holds no .json, .jsonl or .parquet files")
        return _folder_groups(files), None
    entry = find_manifest_entry(source, spec.manifest)
    if entry is not None:
        # as for a hub id: no ~25 s of third-party retries before the same failure (a local folder in the
        # hub's layout needs no hub)
        if not Path(entry.hf_id).expanduser().exists() and not hub_reachable():
            raise FileNotFoundError(f"dataset {source!r} (calibrate/data/datasets.toml: {entry.hf_id} on the "
                                    "Hugging Face hub) cannot be streamed: the hub is unreachable (offline)")
        group = _hub_group(entry.hf_id, split or entry.split, revision or entry.revision, subset or entry.subset)
        return [group], entry
    if _looks_like_hub_id(source) and not looks_like_path(source):
        if not hub_reachable():  # streaming needs the hub; do not let huggingface_hub retry for ~50 s
            raise FileNotFoundError(f"dataset source {source!r} is not a file or folder here, nor a name in "
                                    "data/datasets.toml, and the Hugging Face hub is unreachable (offline)")
        return [_hub_group(source, split, revision, subset)], None
    raise FileNotFoundError(f"dataset source {source!r} is neither a file, a folder, a name in calibrate/data/datasets.toml "
                            "nor a Hugging Face id (org/name)")


def _folder_groups(files: list[Path]) -> Iterator[RowGroup]:
    """One row group per file of a folder. Beside mini-swe-agent trajectories, a .jsonl or .parquet that holds
    conversations is read with them (never dropped unsaid); one whose readable rows are no conversation
    format is the run's index (a manifest listing the trajectories), left out as its report.json files are.
    A file with no readable first rows stays, so its problems are reported."""
    run_folder = any(f.name.endswith(".traj.json") for f in files)
    for f in files:
        if run_folder and not f.name.endswith(".traj.json"):
            head = list(itertools.islice(iter_file_rows(f), DETECT_ROWS))
            if any(r.data is not None for r in head) and _detect(head) is None:
                continue
        yield str(f), iter_file_rows(f)


def _hub_group(dataset_id: str, split: str | None, revision: str | None, subset: str | None) -> RowGroup:
    return (dataset_id, iter_hub_rows(dataset_id, split=split, revision=revision, subset=subset))


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~")) and " " not in source

