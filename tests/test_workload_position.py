"""Workload weighting by running position (`--strata context,position`): a request's `out` tokens put decode
tokens in each position bin its response spans, each (context, position) stratum takes the AL of the measured
steps starting there (`running_counts`), and the weighted AL is sum T_s / sum (T_s / AL_s). Every figure is
recomputed by hand from the steps written.

Output-length decay (arXiv 2605.09329): acceptance falls along a long response, so the position strata matter
where the workload's answers are longer or shorter than the measured ones."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.tables import query
from calibrate.tables.buckets import POSITION_BINS
from calibrate.tables.names import NotMeasured
from calibrate.tables.store import Store, connect
from calibrate.terms import RequestOutcome, StepCounts
from calibrate.workload.profile import decode_positions, read_profile
from calibrate.workload.weighting import Uncovered, Weighting, parse_strata, weighted_records
from tests.tables_support import Req, make_spec, write_run

K = 3
N_BOOT = 200
CONTEXTS = (1200, 5000)  # prompt tokens of the measured requests: two context buckets
LENGTH = 60  # measured responses: steps start at positions 1..59, bins 0..5
MODEL = "eagle3"  # a drafter with a model: its exports carry the AL over all steps


def _walk(n: int, accept: Callable[[int], int]) -> StepCounts:
    """One `n`-token response decoded step by step: the step at position t accepts accept(t) drafts (bounded by
    the response's end), proposing k each time."""
    counts = StepCounts(k=K)
    counts.add_tokens("answer", 1)  # the prefill's token, position 0
    t = 1
    while t < n:
        a = min(accept(t), K, n - t - 1)
        counts.add_step("answer", a, tokens=a + 1, proposed=K, position=t)
        t += a + 1
    return counts


def _decaying(context: int, i: int) -> Callable[[int], int]:
    """AL that falls along the response, differently per context and request (each request's accepts cycle, so
    steps start in every bin)."""
    return lambda t: max(0, (i + t) % 4 - (t.bit_length() - 1) // 2 - (context > 2000) * (t % 2))


def _write(path: Path, accept_of: Callable[[int, int], Callable[[int], int]], speculator: str = MODEL,
           conversations: int = 24, length: int = LENGTH) -> dict[int, list[StepCounts]]:
    """One key: per context, `conversations` requests (one conversation each) of `length` tokens."""
    written: dict[int, list[StepCounts]] = {}
    with Store(path) as store:
        run_id = store.begin_run(make_spec(k=K, speculator=speculator))
        batch = []
        for context in CONTEXTS:
            for i in range(conversations):
                counts = _walk(length, accept_of(context, i))
                written.setdefault(context, []).append(counts)
                batch.append((RequestOutcome(request_id=f"r{context}-{i}", conversation_id=f"c{context}-{i}", turn=1,
                                             turn_depth=1, prompt_tokens=context, truncated_tokens=0,
                                             generated_tokens=length, finish_reason="eos"), {run_id: counts}))
        store.write_requests(batch)
        store.finish_run(run_id)
    return written


def _al(hist: np.ndarray) -> float:
    return 1 + float((hist * np.arange(K + 1)).sum() / hist.sum())


def _bin_al(counts: list[StepCounts], b: int) -> float:
    return _al(sum(c.positions[b] for c in counts if b in c.positions))  # a request may skip a bin


def _by_hand_tokens(out: int) -> dict[int, int]:
    """Decode tokens per position bin, position by position (positions 1..out-1; the prefill emits 0)."""
    tokens: dict[int, int] = {}
    for t in range(1, out):
        b = min(t.bit_length() - 1, POSITION_BINS)
        tokens[b] = tokens.get(b, 0) + 1
    return tokens


def _workload(path: Path, rows: list[tuple[int, int]]) -> Path:
    path.write_text("context_tokens,output_tokens\n" + "".join(f"{c},{o}\n" for c, o in rows))
    return path


def _weigh(db: Path, workload: Path, strata: str = "context,position", nearest: bool = False):
    turn, position = parse_strata(strata)
    weighting = Weighting(read_profile(workload), turn=turn, nearest=nearest, position=position)
    with connect(db, read_only=True) as con:
        (record,) = weighted_records(con, query.Filters(), weighting, n_boot=N_BOOT, seed=0)
    return record


def _invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


def test_decode_tokens_per_position_bin_match_counting_them_one_by_one() -> None:
    assert decode_positions(0) == decode_positions(1) == []  # no decode token: nothing to weight
    assert decode_positions(2) == [(0, 1)] and decode_positions(8) == [(0, 1), (1, 2), (2, 4)]
    for out in (3, 5, 17, 100, 1000, (1 << POSITION_BINS) + 10):
        assert dict(decode_positions(out)) == _by_hand_tokens(out)
        assert sum(n for _, n in decode_positions(out)) == out - 1  # the request's decode tokens, all placed
    assert decode_positions((1 << POSITION_BINS) + 10)[-1] == (POSITION_BINS, 10)  # the last bin is open


def test_strata_names_position_beside_context_and_turn() -> None:
    assert parse_strata("context,position") == (False, True)
    assert parse_strata("context, turn, position") == (True, True)
    with pytest.raises(ValueError, match="--strata"):
        parse_strata("position")


def test_all_decode_tokens_in_one_bin_give_that_bins_al_per_context(tmp_path: Path) -> None:
    """Identity: answers of 2 tokens decode position 1 only (bin 0), so the weighted AL is the context weighting
    with each context's AL replaced by its bin-0 AL: sum T_c / sum (T_c / AL_c,0), T_c = requests x 1."""
    written = _write(tmp_path / "w.duckdb", _decaying)
    workload = _workload(tmp_path / "w.csv", [(1300, 2)] * 3 + [(4500, 2)] * 7)
    record = _weigh(tmp_path / "w.duckdb", workload)
    t = {CONTEXTS[0]: 3, CONTEXTS[1]: 7}
    expected = sum(t.values()) / sum(n / _bin_al(written[c], 0) for c, n in t.items())
    assert record.acceptance_length == pytest.approx(expected, rel=1e-12)
    assert abs(expected - _weigh(tmp_path / "w.duckdb", workload, "context").acceptance_length) > 0.05  # it moved
    assert record.strata == "context at 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1M + position"
    assert record.coverage == 1.0 and record.filled == 0.0


def test_equal_al_in_every_bin_gives_the_weighting_without_position(tmp_path: Path) -> None:
    """Identity: every step of a context accepts the same number of drafts (none in the short context, one in the
    long; responses of 61 tokens, so steps of two tokens fill positions 1..60 exactly), so each bin's AL is its
    context's, and weighting by position gives the weighting without it."""
    written = _write(tmp_path / "w.duckdb", lambda context, i: (lambda t: 0 if context < 2000 else 1), length=61)
    for context, counts in written.items():  # the premise: one AL in every bin of a context
        assert len({_bin_al(counts, b) for b in counts[0].positions}) == 1, context
    workload = _workload(tmp_path / "w.csv", [(1300, 40), (1300, 9), (4500, 25), (4500, 60), (4500, 3)])
    plain = _weigh(tmp_path / "w.duckdb", workload, "context")
    by_position = _weigh(tmp_path / "w.duckdb", workload)
    assert by_position.acceptance_length == pytest.approx(plain.acceptance_length, rel=1e-12)
    t = {CONTEXTS[0]: 39 + 8, CONTEXTS[1]: 24 + 59 + 2}
    assert plain.acceptance_length == pytest.approx(sum(t.values()) / (t[CONTEXTS[0]] / 1 + t[CONTEXTS[1]] / 2),
                                                    rel=1e-12)


def test_each_context_and_position_stratum_weighs_by_hand(tmp_path: Path) -> None:
    written = _write(tmp_path / "w.duckdb", _decaying)
    rows = [(1300, 50), (1300, 7), (4500, 33), (4500, 12), (4500, 60)]
    record = _weigh(tmp_path / "w.duckdb", _workload(tmp_path / "w.csv", rows))
    tokens: dict[tuple[int, int], int] = {}
    for context, out in rows:
        c = CONTEXTS[0] if context < 2048 else CONTEXTS[1]  # 1k-2k and 4k-8k: the measured contexts' buckets
        for b, n in _by_hand_tokens(out).items():
            tokens[(c, b)] = tokens.get((c, b), 0) + n
    expected = sum(tokens.values()) / sum(n / _bin_al(written[c], b) for (c, b), n in tokens.items())
    assert record.acceptance_length == pytest.approx(expected, rel=1e-12)
    assert record.ci_low <= record.acceptance_length <= record.ci_high
    assert record.requests == 48 and record.conversations == 48  # requests, not (request, bin) rows
    assert record.macro_acceptance_length is None and record.drafted_acceptance_length is None
    assert record.weighted_proposal_rate is None and record.unconditional_rates == ()  # not kept per position


def test_bins_beyond_the_measured_responses_are_refused_or_filled_and_flagged(tmp_path: Path) -> None:
    """Measured responses end at position 59 (bin 5); an answer of 200 tokens puts decode tokens at 64..199 (bins
    6, 7), never measured."""
    _write(tmp_path / "w.duckdb", _decaying)
    workload = _workload(tmp_path / "w.csv", [(1300, 200), (1300, 20)])
    with pytest.raises(Uncovered, match=r"context=1k-2k, position=128-255 holds .*; and 1 more strata, 61.8% in all"):
        _weigh(tmp_path / "w.duckdb", workload)
    record = _weigh(tmp_path / "w.duckdb", workload, nearest=True)
    unmeasured = 200 - 64  # output tokens at positions 64..199
    assert record.filled == pytest.approx(unmeasured / 220, rel=1e-12)
    assert record.coverage == pytest.approx(1 - unmeasured / 220, rel=1e-12)


def test_runs_without_running_counts_and_drafted_al_keys_are_refused_in_one_line(tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    with Store(db) as store:  # stored as before running counts: histograms only
        write_run(store, make_spec(k=K, speculator=MODEL),
                  [Req(f"q{i}", f"c{i}", {"answer": [3, 1, 1, 2]}, prompt_tokens=1300) for i in range(12)])
    workload = _workload(tmp_path / "w.csv", [(1300, 20)])
    with pytest.raises(NotMeasured, match="12 of its 12 requests have none stored"):
        _weigh(db, workload)
    res = _invoke("show", "--db", db, "--workload", workload, "--strata", "context,position")
    assert res.exit_code == 1, res.output
    (line,) = [x for x in res.output.splitlines() if x.strip()]
    assert line.startswith("error:") and "--strata position needs AL by running position" in line
    assert _invoke("show", "--db", db, "--workload", workload, "--strata", "context").exit_code == 0
    _write(tmp_path / "ngram.duckdb", _decaying, speculator="ngram")  # drafts every step: drafted AL exported
    res = _invoke("show", "--db", tmp_path / "ngram.duckdb", "--workload", workload, "--strata", "context,position")
    assert res.exit_code == 1 and "drafted AL" in res.output and "not kept per running position" in res.output


def test_show_weighs_by_position_from_the_command_line(tmp_path: Path) -> None:
    _write(tmp_path / "w.duckdb", _decaying)
    workload = _workload(tmp_path / "w.csv", [(1300, 50), (4500, 12)])
    res = _invoke("show", "--db", tmp_path / "w.duckdb", "--workload", workload, "--strata", "context,position",
                  "--format", "json", "--bootstrap", "50")
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout)
    assert row["acceptance_length"] == pytest.approx(_weigh(tmp_path / "w.duckdb", workload).acceptance_length,
                                                     rel=1e-12)
    assert row["strata"].endswith("+ position")


def test_turn_and_position_together_split_both(tmp_path: Path) -> None:
    """Every measured request is a first turn, so with a workload of first turns the turn stratum changes
    nothing; a workload of later turns finds them unmeasured."""
    _write(tmp_path / "w.duckdb", _decaying)
    first = tmp_path / "first.csv"
    first.write_text("context_tokens,output_tokens,turn\n1300,50,1\n4500,12,1\n")
    assert _weigh(tmp_path / "w.duckdb", first, "context,turn,position").acceptance_length == pytest.approx(
        _weigh(tmp_path / "w.duckdb", first).acceptance_length, rel=1e-12)
    later = tmp_path / "later.csv"
    later.write_text("context_tokens,output_tokens,turn\n1300,50,2\n")
    with pytest.raises(Uncovered, match="falls entirely outside .* context=1k-2k, turn=1, position=32-63;"):
        _weigh(tmp_path / "w.duckdb", later, "context,turn,position")
