"""Weighted and filled numbers as their consumers read them (issue 49, items 4 and 6).

specdec_bench's rules are restated from NVIDIA/Model-Optimizer `examples/specdec_bench/specdec_bench/
speculation_profile.py` at edf879d3daf7879acdeb2dab9f54a591837da7b0 (per_step_mean_accept_length, _dense_survival,
build_profile, stub_profile) and `examples/specdec_bench/specdec_bench/metrics/acceptance_rate.py` at
037a9f69dfed18d03975361f136ca80d0459fb25 (AcceptanceRate._process_lengths), the way its own tests rebuild a profile
from a histogram (`examples/specdec_bench/tests/test_speculation_profile.py` at 095124e9d582, _acceptance_out_from_
histogram); re-typed here, never imported.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from calibrate.consumers import CONSUMERS
from calibrate.consumers.lookup import read_exported
from tests.workload_support import BOOT, FIXTURE, K, MODEL, SHORT, context_index, invoke, requests, write_store
from tests.workload_support import short_store, store  # noqa: F401  (the module's fixtures)

FILLED = 1 - 561 / 2232  # the short store's fill of FIXTURE (test_workload_cli)


@pytest.fixture(scope="module")
def short_draft(tmp_path_factory) -> Path:
    """The short store's counts under a draft model, which every engine but ATOM and TileRT runs as measured."""
    db = tmp_path_factory.mktemp("d") / "d.duckdb"
    write_store(db, lengths=SHORT, thinking=("off",), extra={6000: 4}, speculator="draft:qwen2.5-coder-0.5b-instruct")
    return db


# ---- specdec_bench's rules, re-typed -------------------------------------------------------------------------------

def specdec_per_step_mean(histogram: dict) -> float | None:
    """per_step_mean_accept_length: None for an empty histogram, else sum(length * value) / sum(values), keys int()."""
    if not histogram:
        return None
    h = {int(k): float(v) for k, v in histogram.items()}
    n = sum(h.values())
    return sum(k * v for k, v in h.items()) / n if n else None


def specdec_joint(histogram: dict) -> dict[int, float]:
    """AcceptanceRate._process_lengths: conditional rates as ratios of running sums over sorted lengths, the joint
    rate at a length the product of the conditionals up to it."""
    lengths = dict(sorted(((int(k), float(v)) for k, v in histogram.items())))
    total = sum(lengths.values())
    running, prev, joint, product = total, 1.0, {}, 1.0
    for length, count in lengths.items():
        conditional = running / total / prev
        prev = running / total
        running -= count
        product *= conditional
        joint[length] = product
    return joint


def specdec_marginals(joint: dict[int, float], k: int) -> list[float]:
    """_dense_survival: position i is length i + 2, a missing length inherits the value above it."""
    if not joint:
        return [0.0] * k
    survival, carried = {}, 0.0
    for length in range(max(joint), 0, -1):
        carried = joint.get(length, carried)
        survival[length] = carried
    return [survival.get(i + 2, 0.0) for i in range(k)]


def specdec_rebuild(profile: dict) -> dict:
    """What build_profile makes of a profile's histogram and per-request mean (float(Average_AL): a null raises)."""
    histogram = profile["acceptance_length_histogram"]
    per_request = float(profile["mean_accept_length_per_request"])
    mean = specdec_per_step_mean(histogram)
    mean = per_request if mean is None else mean
    marginal = specdec_marginals(specdec_joint(histogram) if histogram else {}, profile["num_speculative_tokens"])
    return {"mean": mean, "marginal": marginal, "consistent": abs(1 + sum(marginal) - mean) <= 0.02}


def _profile(store: Path, tmp_path: Path, workload: Path, *extra: object) -> dict:
    out = tmp_path / "profiles"
    res = invoke("export", "--to", "specdec-profile", "--db", store, "--workload", workload, "--thinking", "off",
                  "--speculator", "ngram", "--out", out, *BOOT, *extra)
    assert res.exit_code == 0, res.output
    (path,) = out.glob("*/speculation_profile.json")
    return json.loads(path.read_text())


def test_a_weighted_profile_is_rebuilt_by_specdec_bench(store: Path, tmp_path: Path) -> None:
    """Issue 49, item 4: weighted profiles carried an empty histogram and a null per-request mean, so
    per_step_mean_accept_length gave None and build_profile failed on every one. Now specdec_bench's own rules,
    applied to the file, rebuild the profile: the per-step mean is the weighted AL `show --workload` reports, the
    marginals are the profile's, the consistency check passes, and the per-request mean is a number."""
    res = invoke("show", "--db", store, "--workload", FIXTURE, "--thinking", "off", "--speculator", "ngram",
                  "--format", "json", *BOOT)
    (shown,) = json.loads(res.stdout)
    profile = _profile(store, tmp_path, FIXTURE)
    assert profile["measured"] is True and profile["measurement_conditions"]["workload"]["filled_from_nearest"] == 0.0
    rebuilt = specdec_rebuild(profile)
    assert rebuilt["mean"] == pytest.approx(shown["acceptance_length"], abs=1e-12)  # shares written unrounded
    assert profile["mean_accept_length"] == round(shown["acceptance_length"], 6) == round(rebuilt["mean"], 6)
    assert [round(x, 6) for x in rebuilt["marginal"]] == profile["marginal_accept_rates"]
    assert rebuilt["consistent"] and profile["validation"]["mean_consistency"]["passed"]
    assert sum(profile["acceptance_length_histogram"].values()) == pytest.approx(1.0, abs=1e-12)
    assert 1 <= profile["mean_accept_length_per_request"] <= K + 1
    res = invoke("export", "--to", "json", "--db", store, "--workload", FIXTURE, "--thinking", "off", "--speculator",
                  "ngram", *BOOT)
    (row,) = json.loads(res.stdout)["records"]  # the table's column is the profile's per-request mean
    assert row["macro_acceptance_length"] == pytest.approx(profile["mean_accept_length_per_request"], abs=1e-6)


def test_the_weighted_histogram_is_the_strata_histograms_mixed_by_step_share(store: Path, tmp_path: Path) -> None:
    """By hand, for a workload of two requests in two context buckets: each stratum's histogram of the requests
    written (workload_support), weighted by its share of the workload's verify steps (T_b / AL_b, T_b the decode
    tokens: output - 1); the per-request mean is the two strata's per-request means, one workload request each."""
    two = tmp_path / "two.csv"
    two.write_text("context_tokens,output_tokens\n1100,51\n2500,71\n")  # 1k-2k and 2k-4k: 50 and 70 decode tokens
    written = requests((500, 1500, 3000, 6000, 12000, 50000, 70000), 12, seed=11, prefix="off-")
    hists, macros, steps = [], [], []
    for bucket, tokens in ((1, 50), (2, 70)):
        mine = [np.asarray(r.segments["answer"], dtype=float) for r in written
                if context_index(r.prompt_tokens) == bucket]
        pooled = np.sum(mine, axis=0)
        al = 1 + (pooled * np.arange(K + 1)).sum() / pooled.sum()
        hists.append(pooled / pooled.sum())
        macros.append(np.mean([1 + (h * np.arange(K + 1)).sum() / h.sum() for h in mine]))
        steps.append(tokens / al)
    shares = np.asarray(steps) / sum(steps)
    mixture = shares[0] * hists[0] + shares[1] * hists[1]
    profile = _profile(store, tmp_path, two)
    assert profile["acceptance_length_histogram"] == {str(a + 1): pytest.approx(x, abs=1e-6)
                                                      for a, x in enumerate(mixture) if x}
    assert profile["mean_accept_length_per_request"] == pytest.approx(np.mean(macros), abs=1e-6)
    assert profile["mean_accept_length"] == pytest.approx(1 + (mixture * np.arange(K + 1)).sum(), abs=1e-6)


# ---- a filled share, where each consumer reads it ------------------------------------------------------------------

def _export(short_store: Path, name: str, out: Path | None, *extra: object):
    return invoke("export", "--to", name, "--db", short_store, "--workload", FIXTURE, "--uncovered", "nearest",
                   "--model-prefix", "qwen2.5c", *BOOT, *(("--out", out) if out else ()), *extra)


def test_a_filled_share_no_field_carries_is_refused_unless_forced(short_draft: Path, tmp_path: Path) -> None:
    """Issue 49, item 6: with --uncovered nearest an InferenceX curve said "74.9% filled" in a comment only, which
    its loader drops (yaml.safe_load of the curve: infx/golden_al_distribution curves.py load_curve, as
    test_engine_consumers reads it); engine env files and flags likewise. Above --max-filled (default 5%) every
    consumer of the registry without a field for the share refuses in one line (exit 2, nothing written) unless
    --force; those with one write it there. Raised --max-filled lets it through unforced."""
    refused = []
    for name, consumer in CONSUMERS.items():
        if name in ("atom", "tilert"):
            continue  # they run no draft model: refused as such, filled or not (test_engine_consumers)
        out = tmp_path / name / ("t.parquet" if name == "parquet" else "")
        cost = ("--cost", "draft=0,verify=linear:0.02") if consumer.needs_cost else ()
        res = _export(short_draft, name, out, *cost)
        if consumer.carries_filled:
            assert res.exit_code == 0, (name, res.output)
            continue
        assert res.exit_code == 2 and res.output.count("\n") == 1, (name, res.output)
        assert (f"74.9% of {FIXTURE.name}'s output tokens filled from the nearest measured stratum, above "
                f"--max-filled 5.0%, and {name} reads no field for it") in res.output
        assert not out.exists() or not any(out.iterdir())
        res = _export(short_draft, name, out, "--force", *cost)
        assert res.exit_code == 0, (name, res.output)
        assert "74.9% filled from the nearest measured stratum" in res.stderr
        res = _export(short_draft, name, tmp_path / f"{name}-raised", "--max-filled", "0.8", *cost)
        assert res.exit_code == 0, (name, res.output)
        refused.append(name)
    assert refused == ["inferencex", "inferencex-reference", "vllm-k-schedule", "sglang", "trtllm", "llamacpp"]
    curve = yaml.safe_load((tmp_path / "inferencex" / "qwen2.5c_draft_model.yaml").read_text())
    assert "filled" not in json.dumps(curve)  # what the loader keeps: the values, nothing about the fill
    res = invoke("export", "--to", "json", "--db", short_draft, "--max-filled", "0.2")
    assert res.exit_code == 2 and "--max-filled bounds what --uncovered nearest fills" in res.output
    res = _export(short_draft, "json", None, "--max-filled", "1.5")
    assert res.exit_code == 2 and "--max-filled 1.5: a share of the workload's output tokens, in [0, 1]" in res.output


def test_the_filled_share_is_in_every_machine_read_field(short_store: Path, tmp_path: Path) -> None:
    """JSON, CSV and Parquet carry `filled` as a column, vLLM's rows `workload.filled_from_nearest`, and the specdec
    profile says `measured` false above --max-filled (specdec_bench's flag for a profile that is no measurement:
    stub_profile sets it false; build_profile true), with the share in measurement_conditions."""
    res = _export(short_store, "json", None)
    (row,) = json.loads(res.stdout)["records"]
    assert row["filled"] == pytest.approx(FILLED)
    res = _export(short_store, "csv", None)
    (row,) = list(csv.DictReader(io.StringIO(res.stdout)))
    assert float(row["filled"]) == pytest.approx(FILLED)
    _export(short_store, "parquet", tmp_path / "t.parquet")
    (record,) = read_exported(tmp_path / "t.parquet")
    assert record.filled == pytest.approx(FILLED)
    res = _export(short_store, "vllm", None)
    assert json.loads(res.stdout)[0]["workload"]["filled_from_nearest"] == pytest.approx(FILLED, abs=1e-4)
    for extra, measured in (((), False), (("--max-filled", "0.8"), True)):
        out = tmp_path / f"p{len(extra)}"
        assert _export(short_store, "specdec-profile", out, *extra).exit_code == 0
        (path,) = out.glob("*/speculation_profile.json")
        profile = json.loads(path.read_text())
        assert profile["measured"] is measured
        assert profile["measurement_conditions"]["workload"]["filled_from_nearest"] == pytest.approx(FILLED, abs=1e-4)
        assert specdec_rebuild(profile)["consistent"]


def test_a_weighted_key_without_positions_is_refused_for_specdec(store: Path) -> None:
    """A weighted key whose engine reported totals only has no per-position counts, so no histogram to mix: the
    profile is refused in one line rather than written with an empty histogram (build_profile needs one)."""
    from dataclasses import replace

    from calibrate.consumers import export
    from calibrate.consumers.lookup import lookup

    record = lookup(MODEL, "ngram", K, "off", table=store, workload=FIXTURE)
    totals_only = replace(record, unconditional_rates=(), rates_ci_low=(), rates_ci_high=(), conditional_rates=(),
                          methods=("sglang",))
    with pytest.raises(ValueError, match=r"weighted to cc_traces_workload.jsonl, but sglang reported totals only, so "
                                         "there is no histogram to weight"):
        export([totals_only], "specdec-profile", None)
