"""CLI commands for who reads the tables: export (every consumer's files) and lookup (one answer, for a runner).

Their options and choices come from the consumer registry (`calibrate.consumers.CONSUMERS`); the store and
filter options, and the records they select, are the tables' (`calibrate.tables.commands`). Errors are one line
on stderr with the exit status of `calibrate.errors`, as there.
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from calibrate import consumers
from calibrate.consumers import exports, inferencex, runner_env
from calibrate.consumers.inferencex import Naming
from calibrate.consumers.lookup import WeightedAnswer, key_filters, lookup_key, open_table, recommended_k
from calibrate.errors import cli_errors
from calibrate.tables.buckets import CONTEXT, bucket_labels, context_bucket
from calibrate.tables.commands import BOOT_OPT, DB_OPT, SEED_OPT, filtered, given_k, option_group
from calibrate.tables.cost import COST_HELP
from calibrate.tables.selection import load_selection
from calibrate.tables.query import FilterOptions
from calibrate.terms import check_k
from calibrate.workload.commands import (BUCKETS_OPT, STRATA_OPT, UNCOVERED_OPT, WINDOW_OPT, WORKLOAD_OPT,
                                         check_workload_options, edges_of, load_weighting, nearest_asked,
                                         weighted_selection)
from calibrate.workload.weighting import Weighting

# Choices the CLI offers come from the consumer registry (calibrate.consumers) and InferenceX's names.
TokenMode = Enum("TokenMode", {mode: mode for mode in consumers.SGLANG_TOKEN_MODES}, type=str)
InferencexEngine = Enum("InferencexEngine", {e: e for e in inferencex.ENGINES}, type=str)
DraftSampleMethod = Enum("DraftSampleMethod", {m: m for m in inferencex.DRAFT_SAMPLE_METHODS}, type=str)


class Mode(str, Enum):
    length = "length"
    rates = "rates"


_EXPORT_FORCE_OPT = typer.Option(
    False, "--force", help="Overwrite files that --out would replace (refused otherwise); also write an engine's "
    "setting or an inferencex curve for an engine that runs the speculator as another algorithm, and (inferencex) "
    "a curve InferenceX ships under a MODEL_PREFIX of another model (each with a warning); and a row the engine "
    "audit marked (its engine's own counts contradict its own tokens).")
# export and lookup: one option, one check (exports.check_max_filled), one refusal (consumers.check_filled).
_MAX_FILLED_OPT = typer.Option(
    exports.MAX_FILLED, "--max-filled", help="With --workload --uncovered nearest: the largest share of the "
    "workload's output tokens filled from the nearest measured stratum written unforced to a consumer that reads no "
    "field for it (InferenceX curves, engine env files and flags, lookup's value and engine forms: a comment only); "
    "above it refused unless --force, and a specdec-profile says measured false. json, csv, parquet and vllm (and "
    "lookup --format json) carry the share as a field.")
_CONTEXT_OPT = typer.Option(
    None, "--context", help=f"Only requests whose prompt, after truncation (what the target saw), is in this bucket "
    f"({bucket_labels(CONTEXT)}; 0-1k and 1M+ spell the ends; other edges with --buckets) or the bucket of this "
    "length (20k, 20000): the AL at a benchmark's length.")



@dataclass(frozen=True)
class WeightingOptions:
    """export's and lookup's context bucket and workload weighting, as the user typed them (None: not given;
    the defaults are the options')."""

    context: str | None = None
    workload: Path | None = None
    buckets: str | None = None
    strata: str = STRATA_OPT.default
    uncovered: str = UNCOVERED_OPT.default
    max_filled: float = _MAX_FILLED_OPT.default
    window: str | None = None

    def check(self) -> None:
        """Refuse an option given without the one it goes with, or out of range, before any table is read."""
        check_workload_options(self.workload, self.strata, self.uncovered, self.buckets, self.context, self.window)
        exports.check_max_filled(self.max_filled, nearest_asked(self.uncovered))

    def loaded(self) -> Weighting:
        """The workload file read and stratified as the options say (`--workload` given)."""
        return load_weighting(self.workload, self.buckets, self.strata, self.uncovered, self.window)

    def lookup_keywords(self) -> dict[str, Any]:
        """What `lookup_key` takes of them (it reads the workload itself; --max-filled is the answer's to check)."""
        return {"context": self.context, "workload": self.workload, "buckets": self.buckets, "strata": self.strata,
                "uncovered": self.uncovered, "window": self.window}


# export and lookup take them as one `weighting: WeightingOptions` argument, declared here once.
weighted = option_group("weighting", (
    ("context", Optional[str], _CONTEXT_OPT), ("workload", Optional[Path], WORKLOAD_OPT),
    ("buckets", Optional[str], BUCKETS_OPT), ("strata", str, STRATA_OPT), ("uncovered", str, UNCOVERED_OPT),
    ("max_filled", float, _MAX_FILLED_OPT), ("window", Optional[str], WINDOW_OPT)), WeightingOptions)

_FORMATS_HELP = "; ".join(f"{c.name}: {c.reads}" for c in consumers.CONSUMERS.values())
_LOOKUP_HELP = ", ".join(consumers.LOOKUP_FORMATS)


@cli_errors
@filtered()
@weighted
def export(
    to: str = typer.Option(..., "--to", help=f"Consumer ({_FORMATS_HELP})."),
    db: Path = DB_OPT,
    out: Optional[Path] = typer.Option(None, "--out",
                                       help="File (inferencex, specdec-profile: file or folder); default stdout."),
    mode: Mode = typer.Option(Mode.length, "--vllm-mode", "--mode",
                              help="length or per-position rates (vllm, llamacpp; atom: rates = rate form)."),
    token_mode: TokenMode = typer.Option(
        consumers.SGLANG_TOKEN_MODES[0], "--token-mode",
        help="sglang: SGLANG_SIMULATE_ACC_TOKEN_MODE (real-draft-token needs --speculative-eagle-topk 1)."),
    model_prefix: Optional[str] = typer.Option(
        None, "--model-prefix", help="inferencex: the runner's MODEL_PREFIX (dsv4, qwen3.5, ...; known targets "
                                     "have one, see calibrate/consumers/inferencex.py MODEL_PREFIXES)."),
    engine: InferencexEngine = typer.Option(
        InferencexEngine.vllm, "--engine", help="inferencex: the engine whose recipe names the method."),
    method: Optional[str] = typer.Option(
        None, "--method", help="inferencex: the recipe's method (default: the engine's for the speculator kind)."),
    draft_sample_method: Optional[DraftSampleMethod] = typer.Option(
        None, "--draft-sample-method", help="inferencex DSpark: the recipe's draft_sample_method (a vllm recipe "
        "hands it to InferenceX's loader; atom's is always probabilistic, sglang's and trtllm's none)."),
    draft_model: Optional[str] = typer.Option(
        None, "--draft-model", help="inferencex: the recipe's draft model path (default: the measured draft)."),
    cost: Optional[str] = typer.Option(None, "--cost", help="vllm-k-schedule: " + COST_HELP),
    filters: FilterOptions = FilterOptions(),
    bootstrap: int = BOOT_OPT,
    seed: int = SEED_OPT,
    force: bool = _EXPORT_FORCE_OPT,
    weighting: WeightingOptions = WeightingOptions(),
) -> None:
    """Export the acceptance table for an engine, InferenceX, specdec_bench, or as a full table."""
    target = consumers.consumer(to)
    weighting.check()
    if weighting.workload is not None:
        if weighting.context is not None:
            raise ValueError("--context picks one bucket; --workload weights over all of them: give one of the two")
        records = weighted_selection(db, filters, weighting.loaded(), bootstrap, seed)
    else:
        records = load_selection(db, filters, target.segments, bootstrap, seed,
                                 bucket=context_bucket(weighting.context, edges_of(weighting.buckets)))
    naming = Naming(model_prefix=model_prefix, method=method, engine=engine.value,
                    draft_sample_method=draft_sample_method.value if draft_sample_method else None,
                    draft_model=draft_model, force=force)
    if cost is not None and not target.needs_cost:
        raise ValueError(f"--cost prices a step for the recommended k: {target.name} has no use for it")
    options = exports.ExportOptions(mode=mode.value, token_mode=token_mode.value, naming=naming,
                                    max_filled=weighting.max_filled, cost=cost)
    written = consumers.export(records, target.name, out, options=options, force=force,
                               tell=lambda line: typer.echo(f"note: {line}", err=True))
    for warning in consumers.export_warnings(records, target.name, options):
        typer.echo(f"warning: {warning}", err=True)
    for r in records:  # what every file says in its own comment or field, where a person reads it too
        if r.filled:
            typer.echo(f"warning: {r.target} | {r.speculator} | k={r.k} | thinking={r.thinking}: "
                       f"{r.workload_note()}", err=True)
    for note in consumers.export_notes(records, target.name, options):
        typer.echo(f"note: {note}", err=True)
    if isinstance(written, str):
        sys.stdout.write(written)
    else:
        for path in written:
            typer.echo(f"wrote {path}", err=True)

@cli_errors
@weighted
def lookup(
    model: Optional[str] = typer.Option(None, "--model", help="Target as users write it (HF id or its last part)."),
    speculator: Optional[str] = typer.Option(None, "--speculator", help="Speculator label; omit if only one."),
    k: Optional[int] = typer.Option(None, "--k", "-k", help="k, drafts per verify step."),
    draft_len: Optional[int] = typer.Option(None, "--draft-len", hidden=True, help="Deprecated: --k."),
    thinking: Optional[str] = typer.Option(None, "--thinking", help="on / off."),
    db: Optional[Path] = typer.Option(None, "--db", "--table",
                                      help="A .duckdb store or an exported .json/.parquet (--table: the same)."),
    format: Optional[str] = typer.Option(None, "--format", help=f"Output form: {_LOOKUP_HELP} (default value)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Dataset name (where the key was measured on several)."),
    temperature: Optional[float] = typer.Option(None, "--temperature",
                                                help="Sampling temperature (where the key was measured at several)."),
    segment: str = typer.Option("all", "--segment", help="all, thinking, answer or tool_call."),
    extrapolate: bool = typer.Option(False, "--extrapolate",
                                     help="Model an unmeasured k from the measured curve (flagged)."),
    mode: Mode = typer.Option(Mode.length, "--vllm-mode", "--mode",
                              help="length or rates: vllm-config / llamacpp-args / atom-args form."),
    shell: bool = typer.Option(False, "--shell", help="Env formats: prefix lines with `export` for eval."),
    from_env: bool = typer.Option(False, "--from-env", help="Ask what an InferenceX runner asks: "
                                  f"{', '.join(runner_env.ENV_VARIABLES)}, k and method from --recipe."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="--from-env: the engine recipe (srtctl / llm-d "
                                          "YAML) whose generation role holds k and the method."),
    golden_dir: Optional[Path] = typer.Option(None, "--golden-dir", help="--from-env --recipe: the golden-curve "
                                              "folder InferenceX's launcher reads (where this table's export was "
                                              "put); the answer must be the value it forces."),
    reference_file: Optional[Path] = typer.Option(None, "--reference-file", help="--from-env with "
                                                  "SYNTHETIC_ACCEPTANCE: the reference AL file InferenceX's recipes "
                                                  "launcher reads; the answer must be the value it forces."),
    weighting: WeightingOptions = WeightingOptions(),
    force: bool = typer.Option(False, "--force", help="Answer in an engine's form for a speculator that engine runs "
                               "as another algorithm (SGLang's NGRAM is not our n-gram; refused otherwise), with a "
                               "warning; and answer for a row the engine audit marked (refused otherwise)."),
    best_k: bool = typer.Option(False, "--best-k", help="Answer which k instead: the throughput-optimal k per batch "
                                "size under --cost (value: the k, or B:k lines; json: the rows), without --k."),
    cost: Optional[str] = typer.Option(None, "--cost", help="With --best-k: " + COST_HELP),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="With --best-k: this batch size only."),
) -> None:
    """The measured AL of one (model, speculator, k, thinking), rendered for a runner or an engine."""
    # The table is read (an export strictly) before anything else: a malformed one is named, whatever else is wrong.
    source = open_table(db) if db is not None else None
    if best_k or cost is not None or batch_size is not None:
        if not best_k or cost is None or from_env or k is not None or draft_len is not None:
            raise ValueError("--best-k needs --cost and answers which k: give neither --k nor --from-env with it")
        _best_k_answer(source, model, speculator, thinking, dataset, temperature, cost, batch_size, format)
        return
    k = given_k(k, draft_len)
    if k is not None:
        check_k([k], "--k")
    match_prefix = False
    if from_env:
        asked = runner_env.question(runner_env.environment(), model=model, speculator=speculator, k=k,
                                    thinking=thinking, recipe=recipe, golden_dir=golden_dir,
                                    reference_file=reference_file)
        model, speculator, k, thinking, match_prefix = (asked.model, asked.speculator, asked.k,
                                                                asked.thinking, asked.prefix)
        if format is None:
            format = _framework_format(asked.framework)
        if asked.override is not None:
            typer.echo(f"warning: SYNTHETIC_ACCEPTANCE_LENGTH={asked.override:g} is set: InferenceX's "
                       "synthetic_acceptance.py forces that AL and reads no table; the measured value below is not "
                       "what this run uses", err=True)
        if asked.default_k:
            typer.echo(f"note: no role of {recipe} names k: InferenceX's synthetic_acceptance.py runs "
                       f"k = {runner_env.REFERENCE_DEFAULT_K}", err=True)
        for note in asked.notes:
            typer.echo(f"note: {note}", err=True)
    else:
        for option, given in (("--recipe", recipe), ("--golden-dir", golden_dir), ("--reference-file", reference_file)):
            if given is not None:
                raise ValueError(f"{option} is read with --from-env (it needs the runner's FRAMEWORK)")
    missing_opts = [name for name, v in (("--model", model), ("--k", k), ("--thinking", thinking))
                    if v is None]
    if missing_opts:
        raise ValueError(f"missing {', '.join(missing_opts)} (or use --from-env)")
    form = format or "value"
    consumers.lookup_consumer(form)  # an unknown form fails before the table is opened
    weighting.check()
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always", WeightedAnswer)
        record = lookup_key(key_filters(model, speculator, k, thinking, dataset, temperature), table=source,
                            extrapolate=extrapolate, segment=segment, match_prefix=match_prefix, force=force,
                            **weighting.lookup_keywords())
    for said in heard:  # a weighted answer to an unweighted question is said where the runner reads its errors
        if issubclass(said.category, WeightedAnswer):
            typer.echo(f"warning: {said.message}", err=True)
        else:
            warnings.showwarning(said.message, said.category, said.filename, said.lineno)
    if from_env:
        asked.check(record.value())  # InferenceX forces what its file holds: answer only that
    options = exports.ExportOptions(mode=mode.value, max_filled=weighting.max_filled)
    sys.stdout.write(consumers.render_lookup(record, form, options, shell, force))
    for note in consumers.lookup_warnings(record, form):
        typer.echo(f"warning: {note}", err=True)
    if record.extrapolated:
        typer.echo(f"note: k={record.k} is extrapolated: {record.extrapolation_method}", err=True)
    if record.workload is not None:
        typer.echo(f"note: {record.workload_note()}", err=True)
    if record.bucket is not None:
        typer.echo(f"note: AL of the requests in {record.bucket} only ({record.requests} requests with a verify "
                   f"step, {record.conversations} conversations)", err=True)


def _best_k_answer(source: object, model: Optional[str], speculator: Optional[str], thinking: Optional[str],
                   dataset: Optional[str], temperature: Optional[float], cost: str, batch_size: Optional[int],
                   form: Optional[str]) -> None:
    """`lookup --best-k`: the recommended k (value: one k, or one `B:k` line per batch size) or its rows (json)."""
    if model is None or thinking is None:
        raise ValueError("--best-k: missing " + ", ".join(n for n, v in (("--model", model), ("--thinking", thinking))
                                                          if v is None))
    if form not in (None, "value", "json"):
        raise ValueError(f"--best-k answers in value or json form, not {form}")
    rows = recommended_k(model, speculator, thinking, cost, table=source, dataset=dataset,  # type: ignore[arg-type]
                         temperature=temperature, batch_size=batch_size)
    if form == "json":
        typer.echo(json.dumps([r.row() for r in rows], indent=2))
    elif len(rows) == 1:
        typer.echo(str(rows[0].k))
    else:
        typer.echo("\n".join(f"{r.batch_size}:{r.k}" for r in rows))


def _framework_format(framework: str | None) -> str:
    """The lookup form a runner's FRAMEWORK reads (registry aliases: dynamo-*, *-disagg, llmd-vllm, ...)."""
    if framework is None:
        raise ValueError("--from-env needs FRAMEWORK set (or --format)")
    found = consumers.FRAMEWORKS.get(framework)
    if found is None or found.lookup_format is None:
        raise ValueError(f"FRAMEWORK={framework!r} has no synthetic-acceptance form; "
                         f"known: {', '.join(consumers.FRAMEWORKS)}")
    return found.lookup_format
