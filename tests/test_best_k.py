"""The recommended k (calibrate.tables.best_k) and its cost models (calibrate.tables.cost), on synthetic stores.

vLLM's schedule shape follows vllm/config/speculative.py at 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443
(`num_speculative_tokens_per_batch_size: list[tuple[int, int, int]]`, inclusive batch-size ranges) and
vllm/v1/spec_decode/dynamic/utils.py at 14b450ca590cbff96e7004bdb147a5d3acf5a4f6 (ranges sorted, disjoint, the
first from 1, k >= 0, the last entry's k held for every larger batch).
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from calibrate.cli import register_tables
from calibrate.errors import ExitCode
from calibrate.tables.best_k import best_k, choose, schedule
from calibrate.tables.cost import CostSpecError, experts_model, parse_spec, read_csv
from calibrate.tables.store import Store
from calibrate.terms import RequestOutcome, SegmentCounts, StepCounts
from tests.tables_support import Req, make_spec, write_run

ALPHA = 0.8
STEPS = 10_000  # per conversation: histograms exact to the count, so AL(k) is the closed form to 1e-4


def geometric_hist(k: int, steps: int) -> list[int]:
    """Counts whose AL is the iid closed form (1 - a^(k+1)) / (1 - a): P(exactly a accepted) = a^a (1 - a) for
    a < k, a^k for a = k, rounded on `steps` steps."""
    p = [ALPHA ** a * (1 - ALPHA) for a in range(k)] + [ALPHA ** k]
    return [int(round(x * steps)) for x in p]


def closed_form_al(k: int) -> float:
    return (1 - ALPHA ** (k + 1)) / (1 - ALPHA)


def curve_store(path: Path, ks: tuple[int, ...], conversations: int = 12) -> Path:
    """One key per k, every k on the same `conversations`, each request's histogram geometric(ALPHA) with
    conversation-to-conversation noise in its step count (so the bootstrap has something to resample)."""
    rng = np.random.default_rng(0)
    with Store(path) as store:
        for k in ks:
            reqs = []
            for c in range(conversations):
                n = STEPS + int(rng.integers(-50, 50))
                hist = geometric_hist(k, n)
                hist[0] += int(rng.integers(0, 200))  # a little extra rejection: the noise the CI sees
                reqs.append(Req(f"r{c}", f"c{c}", {"answer": hist}))
            write_run(store, make_spec(speculator="draft:tiny", k=k), reqs)
    return path


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()
    register_tables(app)
    return app


def invoke(app: typer.Typer, *args: str):
    return CliRunner().invoke(app, list(args))


def test_a_one_k_table_recommends_that_k(tmp_path: Path) -> None:
    """One measured k that pays (AL over its cost > 1) is the answer, with an interval holding it."""
    db = curve_store(tmp_path / "one.duckdb", (3,))
    with duckdb.connect(str(db), read_only=True) as con:
        [row] = best_k(con, parse_spec("draft=0.05,verify=linear:0.02"))
    assert row.k == 3 and row.candidates == (0, 3) and row.batch_size is None
    assert row.k_low <= 3 <= row.k_high and row.share == pytest.approx(1.0)
    assert row.speedup_low <= row.speedup <= row.speedup_high
    assert row.cost == pytest.approx(1 + 0.07 * 3)


def test_a_k_that_does_not_pay_recommends_plain_decoding(tmp_path: Path) -> None:
    """When AL(k) / cost(k) < 1 for every measured k, plain decoding (k = 0) is faster: the answer is 0."""
    db = curve_store(tmp_path / "one.duckdb", (3,))
    with duckdb.connect(str(db), read_only=True) as con:
        [row] = best_k(con, parse_spec("draft=1,verify=linear:0.5"))
    assert row.k == 0 and row.speedup == 1.0 and row.acceptance_length == 1.0


@pytest.mark.parametrize("draft, slope", [(0.05, 0.02), (0.1, 0.05), (0.2, 0.1), (0.0, 0.0)])
def test_known_al_and_known_cost_give_the_analytic_optimum(tmp_path: Path, draft: float, slope: float) -> None:
    """Geometric acceptance with rate a gives AL(k) = (1 - a^(k+1)) / (1 - a); a linear cost 1 + (S + D) k. The
    recommendation is argmax_k AL(k) / cost(k) over 0..8 of the closed forms, and its interval holds it."""
    ks = tuple(range(1, 9))
    db = curve_store(tmp_path / "curve.duckdb", ks)
    speed = {k: closed_form_al(k) / (1 + (draft + slope) * k) for k in (0, *ks)}
    expected = max(speed, key=speed.__getitem__)
    with duckdb.connect(str(db), read_only=True) as con:
        [row] = best_k(con, parse_spec(f"draft={draft},verify=linear:{slope}"))
    assert row.k == expected
    assert row.k_low <= row.k <= row.k_high
    assert row.speedup_low <= row.speedup <= row.speedup_high


def test_the_argmax_is_bootstrapped_over_shared_conversations() -> None:
    """Two k whose ALs are equally good in every replicate but one: the replicates' argmax says so (share),
    and ties go to the smaller k."""
    al = np.array([1.0, 2.0, 2.0])
    boot = np.array([[1.0, 2.0, 2.0], [1.0, 2.0, 2.1], [1.0, 1.9, 2.0], [1.0, 2.0, 2.0]])
    pick = choose((0, 1, 2), al, np.ones(3), boot, level=0.5)
    assert pick.k == 1 and pick.share == pytest.approx(0.5)
    assert pick.k_low <= 1 <= pick.k_high


def test_a_measured_step_time_table_gives_a_k_per_batch_size(tmp_path: Path) -> None:
    """A CSV of step times: cheap verification at B = 1 favours a long k, expensive at B = 64 a short one;
    vLLM's schedule covers every batch size from 1."""
    db = curve_store(tmp_path / "curve.duckdb", (1, 2, 4, 8))
    times = tmp_path / "steps.csv"
    lines = ["k,batch_size,step_time"]
    for b, per_k in ((1, 0.01), (64, 0.6)):
        lines += [f"{k},{b},{10 * (1 + per_k * k)}" for k in (0, 1, 2, 4, 8)]
    times.write_text("\n".join(lines) + "\n")
    with duckdb.connect(str(db), read_only=True) as con:
        rows = best_k(con, read_csv(times))
    by_batch = {r.batch_size: r for r in rows}
    for b, per_k in ((1, 0.01), (64, 0.6)):
        speed = {k: closed_form_al(k) / (1 + per_k * k) for k in (0, 1, 2, 4, 8)}
        assert by_batch[b].k == max(speed, key=speed.__getitem__)
    assert by_batch[1].k == 8 and by_batch[64].k < 8
    assert schedule(rows) == [[1, 63, 8], [64, 64, by_batch[64].k]]


def test_the_expert_profile_prices_verify_by_its_bytes() -> None:
    """verify=experts: the verify pass costs its expert bytes over plain decoding's, plus k draft passes."""
    model = experts_model(parse_spec("draft=0.1,verify=experts"), {(2, 1): (300.0, 200.0), (2, 4): (500.0, 400.0)},
                          "profile")
    assert model.cost(2, 1) == pytest.approx(1.5 + 0.2) and model.cost(2, 4) == pytest.approx(1.25 + 0.2)
    assert model.cost(0, 4) == 1.0 and model.batch_sizes == (1, 4)


@pytest.mark.parametrize("spec, says", [
    ("draft=0.05", "verify missing"),
    ("verify=linear:0.1", "draft missing"),
    ("draft=x,verify=linear:0.1", "draft must be a number"),
    ("draft=-1,verify=linear:0.1", ">= 0"),
    ("draft=0.1,verify=quadratic:2", "verify must be linear:S"),
    ("draft=0.1,verify=linear", "verify must be linear:S"),
    ("draft=0.1,speed=3", "'speed=3' is not one of those"),
    ("draft=0.1,verify=linear:nan", "finite"),
])
def test_a_bad_cost_spec_is_one_line(app: typer.Typer, tmp_path: Path, spec: str, says: str) -> None:
    db = curve_store(tmp_path / "one.duckdb", (3,), conversations=2)
    res = invoke(app, "show", "--db", str(db), "--best-k", "--cost", spec)
    assert res.exit_code == ExitCode.BAD_INPUT, res.output
    assert says in res.output and len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


@pytest.mark.parametrize("text, says", [
    ("k,batch\n0,1\n", "needs the columns"),
    ("k,batch_size,step_time\n1,1,2.0\n", "has no k=0 row"),
    ("k,batch_size,step_time\n0,1,1.0\n0,1,1.0\n", "given twice"),
    ("k,batch_size,step_time\n0,1,abc\n", "row 2"),
    ("k,batch_size,step_time\n0,1,0\n", "step_time > 0"),
])
def test_a_bad_cost_table_is_one_line_naming_the_row(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "steps.csv"
    path.write_text(text)
    with pytest.raises(CostSpecError, match=says):
        read_csv(path)


def test_show_best_k_cli(app: typer.Typer, tmp_path: Path) -> None:
    """The table and JSON; too few conversations withhold the interval as AL's is; experts without a profile
    and --best-k without --cost are one line each."""
    db = curve_store(tmp_path / "curve.duckdb", (1, 2, 4), conversations=3)
    res = invoke(app, "show", "--db", str(db), "--best-k", "--cost", "draft=0.05,verify=linear:0.02",
                 "--format", "json")
    assert res.exit_code == 0, res.output
    import json
    [row] = json.loads(res.output)
    assert row["k"] == 4 and row["k_low"] is None and row["ci_note"].startswith("n too small")
    res = invoke(app, "show", "--db", str(db), "--best-k", "--cost", "draft=0.05,verify=linear:0.02")
    assert res.exit_code == 0 and "Recommended k" in res.output
    res = invoke(app, "show", "--db", str(db), "--best-k", "--cost", "draft=0.05,verify=experts")
    assert res.exit_code == ExitCode.NO_ANSWER and "expert profile" in res.output
    res = invoke(app, "show", "--db", str(db), "--best-k")
    assert res.exit_code == ExitCode.BAD_INPUT and "--cost" in res.output


def test_export_vllm_k_schedule(tmp_path: Path) -> None:
    """`export --to vllm-k-schedule --cost ...`: per curve the --speculative-config keys vLLM reads, its
    num_speculative_tokens the largest scheduled k; without --cost, one line."""
    import json

    from calibrate.cli import app as calibrate_app

    db = curve_store(tmp_path / "curve.duckdb", (1, 2, 4, 8))
    times = tmp_path / "steps.csv"
    times.write_text("k,batch_size,step_time\n" + "".join(
        f"{k},{b},{1 + per_k * k}\n" for b, per_k in ((1, 0.01), (8, 0.3)) for k in (0, 1, 2, 4, 8)))
    res = CliRunner().invoke(calibrate_app, ["export", "--to", "vllm-k-schedule", "--db", str(db), "--cost", str(times)])
    assert res.exit_code == 0, res.output
    [row] = json.loads(res.stdout)
    config = row["speculative_config"]
    entries = config["num_speculative_tokens_per_batch_size"]
    assert entries[0][:2] == [1, 7] and entries[1][:2] == [8, 8] and entries[0][2] == 8
    assert config["num_speculative_tokens"] == max(e[2] for e in entries) and row["al_over"] == "all steps"
    res = CliRunner().invoke(calibrate_app, ["export", "--to", "vllm-k-schedule", "--db", str(db)])
    assert res.exit_code == ExitCode.BAD_INPUT and "needs --cost" in res.output


def test_lookup_recommended_k_from_a_store_and_its_export(tmp_path: Path) -> None:
    """lookup's `recommended_k`: the store's answer has the bootstrap's interval; an exported JSON table gives
    the same point k (its AL over all steps is the store's) and says why it has no interval. The CLI answers
    the k alone, or JSON rows."""
    import json

    from calibrate.cli import app as calibrate_app
    from calibrate.consumers.lookup import recommended_k

    db = curve_store(tmp_path / "curve.duckdb", (1, 2, 4, 8))
    spec = "draft=0.1,verify=linear:0.05"
    [stored] = recommended_k("Qwen2.5-Coder-1.5B-Instruct", None, "off", spec, table=db)
    assert stored.k_low is not None and stored.k_low <= stored.k <= stored.k_high
    exported = tmp_path / "t.json"
    res = CliRunner().invoke(calibrate_app, ["export", "--to", "json", "--db", str(db), "--out", str(exported)])
    assert res.exit_code == 0, res.output
    [point] = recommended_k("Qwen2.5-Coder-1.5B-Instruct", None, "off", spec, table=exported)
    assert point.k == stored.k and point.speedup == pytest.approx(stored.speedup) and point.k_low is None
    assert "no per-request counts" in point.ci_note
    args = ["lookup", "--db", str(db), "--model", "Qwen2.5-Coder-1.5B-Instruct", "--thinking", "off", "--best-k",
            "--cost", spec]
    res = CliRunner().invoke(calibrate_app, args)
    assert res.exit_code == 0 and res.stdout.strip() == str(stored.k), res.output
    res = CliRunner().invoke(calibrate_app, [*args, "--format", "json"])
    assert json.loads(res.stdout)[0]["k"] == stored.k
    res = CliRunner().invoke(calibrate_app, [*args, "--k", "2"])
    assert res.exit_code == ExitCode.BAD_INPUT and "--best-k" in res.output


def test_verify_experts_prices_each_batch_size_from_the_stores_profile(tmp_path: Path) -> None:
    """An MoE store: distinct routed experts per verify step (one layer, no shared experts) 2 / 3 / 6 at
    k = 0 / 1 / 3 for B = 1 and 6 / 7 / 8 for B = 4. The verify cost is their ratio, so B = 1 (a long verify
    step reads up to 3x the experts) recommends k = 1 and B = 4 (6 of 8 experts read anyway) k = 3."""
    from calibrate.replay.experts import ExpertRow, MoeLayer

    distinct = {1: {0: 2, 1: 3, 3: 6}, 4: {0: 6, 1: 7, 3: 8}}
    path = tmp_path / "moe.duckdb"
    with Store(path) as store:
        for k in (1, 3):
            spec = make_spec(speculator="mtp", k=k, method="loop")
            run_id = store.begin_run(spec)
            store.write_expert_layers([run_id], [MoeLayer(0, "mlp.gate", 8, 2, 0, 100, 0)])
            reqs = [Req(f"r{c}", f"c{c}", {"answer": geometric_hist(k, STEPS)}) for c in range(12)]
            experts = {(run_id, r.request_id): [(ExpertRow(kk, 0, b, "router", 100, 100 * (kk + 1), 100 * d[kk], (0,)),
                                                 [r.request_id]) for b, d in distinct.items() for kk in (0, k)]
                       for r in reqs}
            batch = []
            for i, r in enumerate(reqs):
                counts = StepCounts(k=k)
                h = np.asarray(r.segments["answer"], dtype=np.int64)
                counts.segments["answer"] = SegmentCounts(hist=h, tokens=int((h * (np.arange(k + 1) + 1)).sum()),
                                                          censored_steps=0, expected_accepted=None,
                                                          drafted_tokens=int(h.sum()) * k, empty_steps=0)
                batch.append((RequestOutcome(request_id=r.request_id, conversation_id=r.conversation_id, turn=i,
                                             turn_depth=1, prompt_tokens=100, truncated_tokens=0,
                                             generated_tokens=counts.tokens, finish_reason="eos"), {run_id: counts}))
            store.write_requests(batch, experts=experts)
            store.finish_run(run_id)
    with duckdb.connect(str(path), read_only=True) as con:
        rows = {r.batch_size: r for r in best_k(con, parse_spec("draft=0,verify=experts"), n_boot=200)}
    assert rows[1].k == 1 and rows[1].cost == pytest.approx(1.5)
    assert rows[4].k == 3 and rows[4].cost == pytest.approx(8 / 6)
    assert rows[1].speedup == pytest.approx(closed_form_al(1) / 1.5, abs=1e-3)
