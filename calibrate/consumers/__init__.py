"""Every consumer of our tables, one entry each: its names, modes, export, lookup form and runner names.

A consumer is whoever reads what we write: an engine forced to an acceptance length (vLLM, SGLang,
TensorRT-LLM, ATOM, TileRT, llama.cpp), InferenceX's golden curves, specdec_bench's speculation profile, or a
person reading the full table. `export --to`, `lookup --format`, `lookup --from-env`'s FRAMEWORK and the CLI
help all come from `CONSUMERS`; adding a consumer is one entry here (its spelling function beside it) and its
test in `tests/test_engine_consumers.py`. How each engine spells a setting was checked against the engine's
source (`notes/engine-exports.md` of the workplace, and the oracle tests, name file and commit).

This package is who reads the tables, and this registry its index; beside it a consumer with a format of its
own has its module (`inferencex`, `reference_al`, `specdec_profile`), `exports` is what every export shares,
`lookup` answers one question from the store or an exported table (`exported_table` reads one, strictly),
`runner_env` reads what an InferenceX runner asks, and `commands` is `calibrate export` / `lookup`. What was measured is `calibrate.tables`, which
imports nothing from here. The manual's page is docs/exports.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from calibrate.consumers import inferencex, launchers, reference_al, specdec_profile
from calibrate.consumers.exports import (
    MODES, ExportOptions, NothingToExport, Stamp, blocks, check_max_filled, overall, parquet_bytes, render_csv,
    render_json,
)
from calibrate.outfiles import write_files
from calibrate.speculators.runs_on import measured_on, runs_as_measured
from calibrate.tables.records import LENGTH_DIGITS, RATE_DIGITS, AcceptanceRecord, fmt

# SGLANG_SIMULATE_ACC_TOKEN_MODE values (python/sglang/srt/environ.py); the first is the export default.
SGLANG_TOKEN_MODES = ("real-draft-token", "fixed")


# ---- engine spellings: one record -> what the engine reads, k always in the engine's own option ----------

def vllm_config(r: AcceptanceRecord, options: ExportOptions) -> dict[str, object]:
    """The synthetic-acceptance part of vLLM's --speculative-config: a length or k rates, never both."""
    config: dict[str, object] = {"num_speculative_tokens": r.k, "rejection_sample_method": "synthetic"}
    if options.mode == "rates":
        config["synthetic_acceptance_rates"] = list(r.rates)
    else:
        config["synthetic_acceptance_length"] = float(r.value())
    return config


def sglang_lines(r: AcceptanceRecord, options: ExportOptions) -> str:
    """Env lines plus SGLang's own k flags in SGLANG_SPECULATIVE_ARGS.

    token_mode "real-draft-token" (InferenceX's setting: verification sees the drafter's real tokens; SGLang
    refuses it unless --speculative-eagle-topk is 1, which the flags set) or "fixed" (SGLang's default: every
    draft is token id 100). A chain of k drafts is --speculative-num-steps k with --speculative-num-draft-tokens
    k + 1 (the verified token included) at top-k 1.
    """
    args = (f"--speculative-num-steps {r.k} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {r.k + 1}")
    return "\n".join([f"SGLANG_SIMULATE_ACC_LEN={r.value()}", "SGLANG_SIMULATE_ACC_METHOD=match-expected",
                      f"SGLANG_SIMULATE_ACC_TOKEN_MODE={options.token_mode}",
                      f'SGLANG_SPECULATIVE_ARGS="{args}"']) + "\n"


def trtllm_value(r: AcceptanceRecord) -> str:
    """AL - 1 as TensorRT-LLM must read it: an integral value without decimals ('2', not '2.00'), since its
    two-model path and older releases parse the variable with int()."""
    text = fmt(r.accepted_drafts, LENGTH_DIGITS)
    return text.rstrip("0").rstrip(".") if "." in text else text


def trtllm_warning(r: AcceptanceRecord) -> str | None:
    """Why a fractional forced count may be silently ignored, or None when the value is integral."""
    if "." not in trtllm_value(r):
        return None
    return (f"TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS={trtllm_value(r)} is fractional: only the one-model "
            "path (MTP, one-model EAGLE3; get_force_num_accepted_tokens_float in "
            "tensorrt_llm/_torch/speculative/interface.py) of a release that has it reads fractions. The "
            "two-model path (NGRAM, DRAFT_TARGET, two-model EAGLE3) and older releases parse int() and turn "
            "forcing off with only a log warning.")


def trtllm_lines(r: AcceptanceRecord, options: ExportOptions) -> str:
    """TensorRT-LLM counts accepted drafts only (AL - 1); k is speculative_config.max_draft_len of its LLM API
    options, given as the JSON/YAML for --extra_llm_api_options in TRTLLM_SPECULATIVE_CONFIG."""
    config = json.dumps({"speculative_config": {"max_draft_len": r.k}})
    return (f"TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS={trtllm_value(r)}\n"
            f"TRTLLM_SPECULATIVE_CONFIG='{config}'\n")


def atom_args(r: AcceptanceRecord, options: ExportOptions) -> str:
    """ATOM server flags: k, then the length, or (mode rates) the mean per-draft rate (AL - 1) / k."""
    if options.mode == "rates":
        value = ["--spec-decode-acceptance-rate", fmt(r.acceptance_rate, RATE_DIGITS)]
    else:
        value = ["--spec-decode-acceptance-length", r.value()]
    return " ".join(["--num-speculative-tokens", str(r.k), *value]) + "\n"


def llamacpp_args(r: AcceptanceRecord, options: ExportOptions) -> str:
    """llama-server flags: k (--spec-draft-n-max; its default is 3, and rates for another k are refused),
    then --spec-synth-len (target token included) or k unconditional rates."""
    if options.mode == "rates":
        value = ["--spec-synth-rates", ",".join(fmt(x, RATE_DIGITS) for x in r.rates)]
    else:
        value = ["--spec-synth-len", r.value()]
    return " ".join(["--spec-draft-n-max", str(r.k), *value]) + "\n"


def tilert_lines(r: AcceptanceRecord, options: ExportOptions) -> str:
    """TileRT's decode runtime forces acceptance from its environment only (no CLI option), and only serves
    MTP: TILERT_SIMULATE_ACC_LEN is the AL (bonus included), method match-expected, as InferenceX's
    synthetic_acceptance.py writes them (TILERT_VARIABLES); k is the recipe's --with-mtp --num-mtp k."""
    return "\n".join([f"TILERT_SIMULATE_ACC_LEN={r.value()}", "TILERT_SIMULATE_ACC_METHOD=match-expected",
                      f'TILERT_SPECULATIVE_ARGS="--with-mtp --num-mtp {r.k}"']) + "\n"


# ---- the registry -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Basis:
    """Which verification steps an exported AL is the mean over. n-gram and suffix propose nothing at some steps
    (each emits one token), so for them the two differ; a draft model, EAGLE-3 or MTP proposes at every step."""

    name: str  # in files that hold no comment (vLLM's JSON rows)
    says: str  # how a file's header states it
    length: Callable[[AcceptanceRecord], float]  # the unrounded AL on this basis
    note: Callable[[AcceptanceRecord], "str | None"]  # what a user of a model-free row must know, or None


DRAFTED = Basis("drafted steps", "AL = 1 + accepted drafts / steps that proposed drafts, bonus token included (for "
                "a drafter that proposes at every step, the AL over all steps)", lambda r: r.exported_length,
                lambda r: r.model_free_note())
ALL_STEPS = Basis("all steps", "AL = tokens emitted / verification steps, bonus token included, a step that "
                  "proposed nothing counted (it emits 1 token)", lambda r: r.acceptance_length,
                  lambda r: (f"{r.speculator} k={r.k}: mean_accept_length {r.acceptance_length:.4f} is over "
                             f"all steps; the InferenceX and engine exports of this row carry the AL over drafted "
                             f"steps, {r.value()}") if r.uses_drafted else None)

# A writer gets its registry entry (its basis) and returns the content of one file (text to print or save, or
# bytes), or {relative path: text} for a folder of files under `out`; `export` alone touches the disk, after
# checking it overwrites nothing.
Writer = Callable[["Consumer", Sequence[AcceptanceRecord], ExportOptions, Stamp, "Path | None"],
                  "str | bytes | dict[str, str]"]
Render = Callable[[AcceptanceRecord, ExportOptions], str]
Selection = Callable[[Sequence[AcceptanceRecord], ExportOptions], list[str]]
# A merger returns the new text of an existing --out file that the consumer shares with others (its entry, its
# existing text, then the records, options, stamp, `force`, the path, and where to tell what `force`
# replaced); it refuses what would replace a value unforced.
Tell = Callable[[str], None]
Merger = Callable[["Consumer", str, Sequence[AcceptanceRecord], ExportOptions, Stamp, bool, Path, Tell], str]


@dataclass(frozen=True)
class Consumer:
    """One consumer: how `export --to NAME` writes for it and how `lookup` answers in its form.

    `basis`: the steps its AL is a mean over, and `why` it gets that basis (its own collector's, or, where the
    consumer's definition is silent, our choice and its reason); None for the full tables, which carry both,
    each in its own column. `engine`: an engine setting (one value per key, segment all). `segments`: its export
    needs the per-segment records too. `modes`: accepted --mode values (empty: --mode means nothing here).
    `render`: one record as the engine reads it (lookup, and the export's blocks). `env`: render gives KEY=VALUE
    lines (lookup adds a comment line, --shell prefixes `export`). `dialects`: the InferenceX recipe dialects
    whose FRAMEWORK values run this engine; which FRAMEWORK values those are is launchers.py's table, the one
    place it is kept (`frameworks` derives them). `runners`: our own runners' FRAMEWORK values for it, which no
    InferenceX launcher runs (so they have no dialect). `serves`: speculator kinds
    the engine runs at all; a setting for another is refused, not written. `forces`: the engine the setting
    forces, as calibrate.speculators.runs_on names it; a setting for a kind that engine does not run as measured
    (SGLang's NGRAM is not our n-gram) is refused unless forced, and then written with a warning.
    """

    name: str
    reads: str
    write: Writer
    basis: Basis | None = DRAFTED
    why: str = ("the engine forces it on the steps where its drafter proposes: a step with no draft has nothing "
                "to accept")
    engine: bool = True
    segments: bool = False
    modes: tuple[str, ...] = ("length",)
    lookup_format: str | None = None
    render: Render | None = None
    env: bool = False
    dialects: tuple[str, ...] = ()  # recipe dialects (launchers.py) whose FRAMEWORK values mean this consumer
    runners: tuple[str, ...] = ()  # our own runners' FRAMEWORK values for it (no InferenceX launcher runs them)
    serves: frozenset[str] | None = None  # the speculator kinds the engine can run (None: any)
    forces: str | None = None  # the engine whose drafter the setting forces (None: not an engine's setting)
    warnings: Selection | None = None  # what the user must know beyond the basis note
    notes: Selection | None = None  # what the consumer will do with the export
    merge: Merger | None = None  # --out is a file shared with other writers: merge into it, never overwrite it
    # a field its reader reads (not a comment) carries a weighted record's filled share (check_filled)
    carries_filled: bool = False
    needs_cost: bool = False  # the export recommends k: it needs `--cost` (calibrate.tables.cost)

    @property
    def frameworks(self) -> dict[str, str | None]:
        """Runner FRAMEWORK values that mean this consumer -> the recipe dialect `lookup --from-env --recipe`
        reads (None for our own runners): the newest launchers' FRAMEWORK values of its dialects, then `runners`."""
        return {**launchers.frameworks_reading(self.dialects), **dict.fromkeys(self.runners)}

    @property
    def basis_line(self) -> str:
        """The basis and why, as a file's header states it."""
        assert self.basis is not None  # only consumers with one basis state it
        return f"{self.basis.says}; {self.why}"


def _engine_blocks(render: Render) -> Writer:
    """An env file / args catalogue: its basis, then per key a comment naming it and the engine lines."""
    return lambda c, records, options, stamp, out: f"# {c.basis_line}\n" + blocks(records,
                                                                                 lambda r: render(r, options))


def _write_vllm(c: Consumer, records: Sequence[AcceptanceRecord], options: ExportOptions, stamp: Stamp,
                out: Path | None) -> str:
    """A JSON list: per key, the --speculative-config fragment to merge into the runner's own, and its basis."""
    assert c.basis is not None
    rows = [{"model": r.target, "speculator": r.speculator, "draft_len": r.k, "thinking": r.thinking,
             "dataset": r.dataset, "temperature": r.temperature, **({"bucket": r.bucket} if r.bucket else {}),
             "al_over": c.basis.name, **({"workload": r.workload_fields()} if r.workload else {}),
             "speculative_config": vllm_config(r, options)}
            for r in overall(records)]
    return json.dumps(rows, indent=2) + "\n"


def _write_vllm_schedule(c: Consumer, records: Sequence[AcceptanceRecord], options: ExportOptions, stamp: Stamp,
                         out: Path | None) -> str:
    """A JSON list: per curve (a key without k), vLLM's `num_speculative_tokens_per_batch_size` for the k of
    highest AL / cost at each batch size the --cost model prices (calibrate.tables.best_k), with
    `num_speculative_tokens` its largest k (vLLM caps every entry at it)."""
    from calibrate.tables.best_k import GROUP_FIELDS, record_curves, recommend, schedule
    from calibrate.tables.cost import CostModel, read_cost

    if options.cost is None:
        raise ValueError("vllm-k-schedule needs --cost (what a step costs: calibrate show --best-k --help)")
    cost = read_cost(options.cost)
    if not isinstance(cost, CostModel) and cost.verify == "experts":
        raise ValueError("vllm-k-schedule: verify=experts prices steps from the store's MoE profile, which an "
                         "export does not read: `calibrate show --best-k --format json` gives its k per batch size")
    rows = []
    for curve in record_curves(records):
        model = cost if isinstance(cost, CostModel) else cost.model(curve.ks)
        best = recommend(curve, model)
        entries = schedule(best)
        named = dict(zip(GROUP_FIELDS, curve.group))
        # a curve weighted to a workload names it, its window and coverage, as vLLM's rows do
        weighted = next((r for r in records
                         if r.workload and tuple(getattr(r, f) for f in GROUP_FIELDS) == curve.group), None)
        if all(k == 0 for _, _, k in entries):
            raise NothingToExport(f"{named['target']} | {named['speculator']} | thinking={named['thinking']}: plain "
                                  f"decoding is faster than every measured k at every batch size under {model.source}"
                                  ": serve it without speculation")
        rows.append({"model": named["target"], "speculator": named["speculator"], "thinking": named["thinking"],
                     "dataset": named["dataset"], "temperature": named["temperature"], "al_over": c.basis.name,
                     **({"workload": weighted.workload_fields()} if weighted else {}), "cost_model": model.source,
                     "speedup": {str(r.batch_size or "any"): round(r.speedup, 4) for r in best},
                     "speculative_config": {"num_speculative_tokens": max(k for _, _, k in entries),
                                            "num_speculative_tokens_per_batch_size": entries}})
    return json.dumps(rows, indent=2) + "\n"


def inferencex_documents(records: Sequence[AcceptanceRecord], options: ExportOptions,
                         stamp: Stamp) -> dict[str, str]:
    """One golden curve YAML per curve InferenceX resolves: {file name: text}."""
    return _inferencex_documents(CONSUMERS["inferencex"], records, options, stamp)


def _inferencex_documents(c: Consumer, records: Sequence[AcceptanceRecord], options: ExportOptions,
                          stamp: Stamp) -> dict[str, str]:
    return {curve.file_name: inferencex.document(curve, rows, str(stamp), c.basis_line, basis_notes(c, rows))
            for curve, rows in _curves(records, options)}


def _write_inferencex(c: Consumer, records: Sequence[AcceptanceRecord], options: ExportOptions, stamp: Stamp,
                      out: Path | None) -> str | dict[str, str]:
    docs = _inferencex_documents(c, records, options, stamp)
    if out is not None and (out.is_dir() or out.suffix not in (".yaml", ".yml")):
        return docs  # a folder: one file per curve, named as InferenceX resolves it
    if out is not None and len(docs) > 1:
        raise ValueError(f"{len(docs)} curves ({', '.join(docs)}) but InferenceX reads one model per file: "
                         "give --out a folder, or filter to one model and speculator")
    if out is not None and out.name not in docs:
        raise ValueError(f"InferenceX would never open {out.name}: it resolves this curve as {next(iter(docs))} "
                         "(give --out a folder, or that name)")
    return "---\n".join(docs.values())


def _inferencex_notes(records: Sequence[AcceptanceRecord], options: ExportOptions) -> list[str]:
    """Which file InferenceX loads for which recipe (and that it replaces a curve InferenceX ships)."""
    return [n for curve, rows in _curves(records, options) for n in inferencex.curve_notes(curve, rows)]


def _inferencex_warnings(records: Sequence[AcceptanceRecord], options: ExportOptions) -> list[str]:
    """Curves the runners find no value in, named for another model, or for another engine's algorithm."""
    return [w for curve, rows in _curves(records, options) for w in inferencex.curve_warnings(curve, rows)]


def _curves(records: Sequence[AcceptanceRecord],
            options: ExportOptions) -> list[tuple[inferencex.Curve, list[AcceptanceRecord]]]:
    return sorted(inferencex.groups(records, options.naming).items(), key=lambda kv: kv[0].name)


def _write_reference(c: Consumer, records: Sequence[AcceptanceRecord], options: ExportOptions, stamp: Stamp,
                     out: Path | None) -> str:
    return reference_al.document(records, options.naming.model_prefix, str(stamp), c.basis_line)


def _merge_reference(c: Consumer, existing: str, records: Sequence[AcceptanceRecord], options: ExportOptions,
                     stamp: Stamp, force: bool, out: Path, tell: Tell) -> str:
    return reference_al.merge(existing, records, options.naming.model_prefix, str(stamp), force, str(out), tell,
                              c.basis_line)


def _trtllm_warnings(records: Sequence[AcceptanceRecord], options: ExportOptions) -> list[str]:
    return [w for r in overall(records) if (w := trtllm_warning(r)) is not None]


def _write_profiles(c: Consumer, records: Sequence[AcceptanceRecord], options: ExportOptions, stamp: Stamp,
                    out: Path | None) -> str | dict[str, str]:
    docs = specdec_profile.documents(records, str(stamp), c.basis_line, options.max_filled)
    if out is not None and (out.is_dir() or out.suffix != ".json"):
        return docs  # a folder: one KEY/speculation_profile.json per key
    if len(docs) > 1:
        raise ValueError(f"{len(docs)} keys ({', '.join(d.split('/')[0] for d in docs)}) but a speculation profile "
                         "describes one: give --out a folder, or filter to one model, speculator, k and thinking mode")
    return next(iter(docs.values()))


def _write_parquet(c: Consumer, records: Sequence[AcceptanceRecord], options: ExportOptions, stamp: Stamp,
                   out: Path | None) -> bytes:
    if out is None:
        raise ValueError("parquet is binary: give --out PATH")
    return parquet_bytes(records, stamp)


# InferenceX's golden curves and its reference file come from one collector (infx/golden_al_distribution/README.md
# at 2e7b70492d76: "AL = 1 + (delta accepted draft tokens / delta verification drafts)" of vLLM's counters), so
# they carry its basis; specdec_bench's AcceptanceRate (examples/specdec_bench/specdec_bench/metrics/
# acceptance_rate.py at 037a9f69dfed18d03975361f136ca80d0459fb25, process_step) counts the tokens of every engine
# iteration, one when nothing was proposed, so its profile carries the AL over all steps.
INFERENCEX_WHY = ("as InferenceX's collector counts it: 1 + delta accepted draft tokens / delta verification drafts "
                  "of vLLM's counters, which count only steps that drafted")
SPECDEC_WHY = ("as specdec_bench's AcceptanceRate counts it: the tokens of every engine iteration, 1 when nothing "
               "was proposed")
THROUGHPUT_WHY = ("throughput is tokens per verify step: a step that proposed nothing still costs a target pass "
                  "and emits one token")
TABLE_WHY = "both, each in its column: acceptance_length (all steps) and drafted_acceptance_length (drafted steps)"

CONSUMERS: dict[str, Consumer] = {c.name: c for c in (
    Consumer("inferencex", "InferenceX {MODEL_PREFIX}_{method}.yaml in " + inferencex.golden_dirs(), _write_inferencex,
             why=INFERENCEX_WHY, warnings=_inferencex_warnings, notes=_inferencex_notes),
    Consumer("inferencex-reference", f"InferenceX {reference_al.REFERENCE_FILE} (synthetic_acceptance.py; "
             "merged into an existing --out)", _write_reference, why=INFERENCEX_WHY,
             warnings=lambda rs, o: reference_al.warnings(rs, o.naming.model_prefix),
             notes=lambda rs, o: reference_al.notes(rs, o.naming.model_prefix), merge=_merge_reference),
    Consumer("vllm", "vLLM --speculative-config fragments", _write_vllm, modes=MODES, lookup_format="vllm-config",
             render=lambda r, o: json.dumps(vllm_config(r, o)) + "\n", forces="vllm", carries_filled=True,
             dialects=("vllm", "llmd")),
    Consumer("vllm-k-schedule", "vLLM --speculative-config num_speculative_tokens_per_batch_size (needs --cost)",
             _write_vllm_schedule, basis=ALL_STEPS, why=THROUGHPUT_WHY, engine=False, modes=(), needs_cost=True),
    Consumer("sglang", "SGLang SGLANG_SIMULATE_ACC_* env and speculative flags", _engine_blocks(sglang_lines),
             lookup_format="sglang-env", render=sglang_lines, env=True, forces="sglang",
             dialects=("sglang",)),
    Consumer("trtllm", "TensorRT-LLM TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS env", _engine_blocks(trtllm_lines),
             lookup_format="trtllm-env", render=trtllm_lines, env=True, warnings=_trtllm_warnings, forces="trtllm",
             dialects=("trtllm",)),
    Consumer("atom", "ATOM server flags", _engine_blocks(atom_args), modes=MODES, lookup_format="atom-args",
             render=atom_args, dialects=("atom",), forces="atom"),
    Consumer("tilert", "TileRT TILERT_SIMULATE_ACC_* env (MTP)", _engine_blocks(tilert_lines),
             lookup_format="tilert-env", render=tilert_lines, env=True, dialects=("tilert",),
             serves=frozenset(inferencex.RECIPE_METHODS["tilert"]), forces="tilert"),
    Consumer("llamacpp", "llama-server flags", _engine_blocks(llamacpp_args), modes=MODES,
             lookup_format="llamacpp-args", render=llamacpp_args,
             runners=("llamacpp", "llama.cpp"), forces="llama.cpp"),
    Consumer("specdec-profile", "specdec_bench speculation_profile.json v1.0 (Dynamo mocker, AIC)", _write_profiles,
             basis=ALL_STEPS, why=SPECDEC_WHY, engine=False, segments=True, modes=(), carries_filled=True),
    Consumer("csv", "the full table as CSV", lambda c, rs, o, st, out: render_csv(rs), basis=None, why=TABLE_WHY,
             engine=False, segments=True, modes=(), carries_filled=True),
    Consumer("parquet", "the full table as Parquet (needs --out)", _write_parquet, basis=None, why=TABLE_WHY,
             engine=False, segments=True, modes=(), carries_filled=True),
    Consumer("json", "the full table as JSON (lookup reads it)", lambda c, rs, o, st, out: render_json(rs, st),
             basis=None, why=TABLE_WHY, engine=False, segments=True, modes=(), carries_filled=True),
)}



def _index(pairs: Sequence[tuple[str, Consumer | None]], what: str) -> dict[str, Consumer | None]:
    """A name -> consumer map that refuses, at import, a name two entries claim (a dict would keep the last),
    or a runner name that is another consumer's name (`consumer` would never reach it)."""
    out: dict[str, Consumer | None] = {}
    for name, c in pairs:
        if name in out or (what == "FRAMEWORK" and CONSUMERS.get(name, c) is not c):
            raise RuntimeError(f"{what} {name!r} is claimed twice in CONSUMERS")
        out[name] = c
    return out


# lookup --format: the record's value and the full record, then each consumer's form.
LOOKUP_FORMATS = _index([("value", None), ("json", None),
                         *((c.lookup_format, c) for c in CONSUMERS.values() if c.lookup_format)], "lookup format")
# Runner FRAMEWORK values (lookup --from-env) and export --to aliases.
FRAMEWORKS: dict[str, Consumer] = _index([(fw, c) for c in CONSUMERS.values() for fw in c.frameworks],
                                         "FRAMEWORK")  # type: ignore[assignment]


def consumer(name: str) -> Consumer:
    """The consumer `export --to NAME` means (its name, or a runner FRAMEWORK value that names it)."""
    key = name.strip().lower()
    found = CONSUMERS.get(key) or FRAMEWORKS.get(key)
    if found is None:
        raise ValueError(f"unknown export format {name!r}; formats: {', '.join(CONSUMERS)}")
    return found


def check_served(c: Consumer, records: Sequence[AcceptanceRecord]) -> None:
    """Refuse a setting for a speculator the engine cannot run (it would force an AL nobody measured there)."""
    for r in records:
        if c.serves is not None and r.speculator.partition(":")[0] not in c.serves:
            raise ValueError(f"{c.name} runs speculator kinds {', '.join(sorted(c.serves))} only; {r.speculator} is "
                             "none of them: filter with --speculator")


def check_audit(records: Sequence[AcceptanceRecord], force: bool) -> None:
    """Refuse, unless forced, a row whose engine's own step counts contradict its own tokens (the engine audit,
    calibrate.engines.audit): an exact sampler has no such step, so the row measures a fault, not the
    speculator, and a benchmark forced to it would be forced to the fault."""
    marked = [r for r in records if r.segment == "all" and r.contradicted() is not None]
    if marked and not force:
        raise NothingToExport(marked[0].contradicted() + (f", and {len(marked) - 1} more rows" if len(marked) > 1 else "")
                              + ": refused (an exact sampler has none); pass --force to use it anyway")


def other_algorithm(c: Consumer, r: AcceptanceRecord) -> str | None:
    """Why the engine the consumer's setting forces does not run the record's speculator as measured here, or
    None (calibrate.speculators.runs_on): the setting would force our AL on a drafter of its own."""
    if c.forces is None or runs_as_measured(r.kind, c.forces):
        return None
    return (f"{r.speculator} k={r.k}: {c.forces} does not run it as measured here (it runs as measured on "
            f"{measured_on(r.kind)}), so the {c.name} setting forces our AL on a drafter of {c.forces}'s own: the "
            f"numbers are ours, not {c.forces}'s")


def check_algorithm(c: Consumer, records: Sequence[AcceptanceRecord], force: bool) -> None:
    """Refuse, unless forced, a setting for an engine that runs the speculator as another algorithm."""
    for r in records:
        other = other_algorithm(c, r)
        if other is not None and not force:
            raise ValueError(f"{other}: pass --force to write it anyway")


def check_filled(reader: str | None, carries: bool, records: Sequence[AcceptanceRecord], max_filled: float,
                 force: bool) -> None:
    """Refuse, unless forced, a weighted record filled from the nearest measured stratum above `max_filled` of its
    workload's output tokens for a consumer that reads no field for the share: InferenceX's loaders and the
    engines drop the comment that says it, and lookup's bare value has none, so the benchmark would take the fill
    for our measurement. `reader` (a consumer, or a lookup form) `carries` it in a field: the tables, vLLM's rows
    (`workload.filled_from_nearest`), the specdec profile (`measured` false) and lookup's json. `reader` None:
    a Python caller of `lookup` that set `max_filled` itself (its record carries the share, but it asked a bound)."""
    over = [r for r in records if (r.filled or 0.0) > max_filled]
    if carries or force or not over:
        return
    r = over[0]
    more = f" (and {len(over) - 1} more rows)" if len(over) > 1 else ""
    carry = ", ".join(n for n, e in CONSUMERS.items() if e.carries_filled)
    said = (f"{r.target} | {r.speculator} | k={r.k} | thinking={r.thinking}: {r.filled:.1%} of {r.workload}'s "
            f"output tokens filled from the nearest measured stratum{more}, above ")
    if reader is None:
        raise ValueError(said + f"max_filled={max_filled:.1%}, the bound asked: pass force=True to take it anyway")
    raise ValueError(said + f"--max-filled {max_filled:.1%}, and {reader} reads no field for it (a comment only): pass "
                     f"--force to write it anyway, or use a form that carries it (export --to {carry}; lookup --format "
                     "json)")


def check_options(c: Consumer, options: ExportOptions) -> None:
    """Refuse an option value the consumer has no use for, rather than ignore it."""
    check_max_filled(options.max_filled)
    if c.modes and options.mode not in c.modes:
        raise ValueError(f"{c.name} has no --mode {options.mode} (modes: {', '.join(c.modes)})")
    if options.token_mode not in SGLANG_TOKEN_MODES:
        raise ValueError(f"unknown SGLang token mode {options.token_mode!r}; modes: {', '.join(SGLANG_TOKEN_MODES)}")


def export(records: Sequence[AcceptanceRecord], to: str, out: Path | None, *,
           options: ExportOptions = ExportOptions(), stamp: Stamp | None = None,
           force: bool = False, tell: Tell = lambda line: None) -> str | list[Path]:
    """Write `records` for consumer `to` to `out` (a file, or a folder for inferencex / specdec-profile), or
    return the text. Parquet, being binary, needs `out`; an existing file is overwritten only with `force`
    (a consumer that merges, inferencex-reference, merges into it instead, replacing a value only with `force`),
    and nothing is written when one would be refused; `tell` hears what a forced merge replaced. An engine's
    setting for a speculator that engine runs as another algorithm is written only with `force` too."""
    c = consumer(to)
    check_options(c, options)
    if not records:
        raise NothingToExport("nothing to export: no measured keys match the filters")
    check_served(c, records)
    check_algorithm(c, records, force)
    check_audit(records, force)
    check_filled(c.name, c.carries_filled, records, options.max_filled, force)
    stamp = stamp or Stamp.now()
    content = c.write(c, records, options, stamp, out)
    if c.merge is not None and out is not None and out.is_file():
        merged = c.merge(c, out.read_text(encoding="utf-8"), records, options, stamp, force, out, tell)
        return write_files(merged, out, True)
    if out is None:
        assert isinstance(content, str)  # only a folder of files and parquet need `out`
        return content
    return write_files(content, out, force)


def basis_notes(c: Consumer, records: Sequence[AcceptanceRecord]) -> list[str]:
    """One line per n-gram / suffix record: what its number is on the consumer's basis (and what the other
    basis's exports carry)."""
    return [n for r in overall(records) if (n := c.basis.note(r)) is not None] if c.basis is not None else []


def export_warnings(records: Sequence[AcceptanceRecord], to: str,
                    options: ExportOptions = ExportOptions()) -> list[str]:
    """What the user must know before using an export: numbers the engine will not reproduce, values the
    consumer may ignore, curves it will not find."""
    c = consumer(to)
    return (basis_notes(c, records) + [o for r in overall(records) if (o := other_algorithm(c, r)) is not None]
            + (c.warnings(records, options) if c.warnings is not None else []))


def export_notes(records: Sequence[AcceptanceRecord], to: str, options: ExportOptions = ExportOptions()) -> list[str]:
    """What the consumer will do with the export (InferenceX: which file it loads for which recipe)."""
    c = consumer(to)
    return c.notes(records, options) if c.notes is not None else []


def lookup_consumer(form: str) -> Consumer | None:
    """The consumer behind a lookup --format (None for value / json)."""
    if form not in LOOKUP_FORMATS:
        raise ValueError(f"unknown lookup format {form!r}; formats: {', '.join(LOOKUP_FORMATS)}")
    return LOOKUP_FORMATS[form]


def render_lookup(record: AcceptanceRecord, form: str, options: ExportOptions = ExportOptions(),
                  shell: bool = False, force: bool = False) -> str:
    """A lookup answer as text for stdout; env forms carry a comment line saying what they are. An engine's
    form for a speculator that engine runs as another algorithm is a ValueError unless `force`."""
    c = lookup_consumer(form)
    check_filled(f"lookup --format {form}", c.carries_filled if c is not None else form == "json", [record],
                 options.max_filled, force)
    if c is None:
        return record.value() + "\n" if form == "value" else json.dumps(record.to_dict(), indent=2) + "\n"
    check_options(c, options)
    check_served(c, [record])
    check_algorithm(c, [record], force)
    assert c.render is not None  # every consumer with a lookup format renders one record
    text = c.render(record, options)
    if not c.env:
        return text
    comment = (f"# {record.target} | {record.speculator} | k={record.k} | thinking={record.thinking}"
               + (f" | drafted AL, proposal rate {record.proposal_rate:.2f}" if record.uses_drafted else "")
               + (f" | EXTRAPOLATED: {record.extrapolation_method}" if record.extrapolated else "")
               + (f" | requests {record.bucket}" if record.bucket else "")
               + (f" | {record.workload_note()}" if record.workload else "") + "\n")
    prefix = "export " if shell else ""
    return comment + "".join(prefix + line + "\n" for line in text.splitlines())


def lookup_warnings(record: AcceptanceRecord, form: str) -> list[str]:
    """The model-free note (every form: the value is a drafted AL), another algorithm's engine (a forced
    answer), and the consumer's own warning."""
    c = lookup_consumer(form)
    own = c.warnings([record], ExportOptions()) if c is not None and c.warnings is not None else []
    other = other_algorithm(c, record) if c is not None else None
    return [n for n in (record.model_free_note(), other, *own) if n is not None]
