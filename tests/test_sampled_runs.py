"""Sampled rows through `calibrate run`: the engine auto picks, several samples per request, resuming them,
and the config checks that refuse what would not be a sampled row."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import ConfigError, load_config
from calibrate.plan import load_routed_config
from calibrate.prepared import response_id
from calibrate.runner import execute, request_key
from tests.configs import QUICKSTART, write_config
from tests.tables_support import rows
from tests.tiny_pair import build_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"))


def sampled_config(path, target, draft, **sweep):
    return write_config(
        path,
        dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "max_requests": 3,
                 "context_tokens": 192, "max_new_tokens": 16},
        run={"device": "cpu", "dtype": "float32", "batch_size": 4, **sweep.pop("run", {})},
        pairs=[{"target": target, "speculators": [{"kind": "draft", "model": draft}, {"kind": "ngram"}]}],
        sweep={"k": [1, 3], "temperature": [0.9], **sweep},
    )


def test_samples_are_rows_of_their_own_and_resume_one_by_one(tmp_path, pair):
    target, draft = pair
    db = tmp_path / "s.duckdb"
    first = execute(load_config(sampled_config(tmp_path / "a.toml", target, draft, samples=2)), db)
    assert first.measured == 6 and first.resumed == 0  # 3 requests x 2 samples
    runs = rows(db, "SELECT DISTINCT method, verification, sampling_seed FROM runs")
    assert runs == [("replay", "target-only", 0)]  # auto: the target-only rule at T > 0 replays
    stored = rows(db, "SELECT DISTINCT request_id, conversation_id, sample FROM requests ORDER BY 1")
    assert sorted(s for *_, s in stored) == [0, 0, 0, 1, 1, 1]
    for request_id, conversation, sample in stored:
        base = request_id.split("~")[0]
        assert request_id == response_id(base, sample) and base.startswith(conversation)
    before = rows(db, "SELECT run_id, request_id, segment, accepted, steps FROM accept_counts ORDER BY ALL")
    # One more sample each: only the new ones are measured, and the earlier counts stay as they were.
    more = execute(load_config(sampled_config(tmp_path / "b.toml", target, draft, samples=3)), db)
    assert more.measured == 3 and more.resumed == 6
    after = rows(db, "SELECT run_id, request_id, segment, accepted, steps FROM accept_counts ORDER BY ALL")
    assert set(before) <= set(after) and len(rows(db, "SELECT * FROM requests")) == 3 * 3 * 2 * 2
    # each sample its own random stream: the responses of one request differ
    lengths = rows(db, "SELECT request_id, generated_tokens FROM requests")
    assert len({request_key(r) for r, _ in lengths}) == 9
    shown = CliRunner().invoke(app, ["show", "--db", str(db)])
    words = " ".join(shown.output.split())
    assert shown.exit_code == 0 and "reqs: responses, up to 3 sampled per request" in words, shown.output


def test_auto_keeps_the_loop_for_the_probabilistic_rule(tmp_path, pair):
    target, draft = pair
    db = tmp_path / "p.duckdb"
    execute(load_config(sampled_config(tmp_path / "p.toml", target, draft, run={"verification": "probabilistic"})),
            db)
    assert rows(db, "SELECT DISTINCT method, verification FROM runs") == [("loop", "probabilistic")]


@pytest.mark.parametrize("sweep, message", [
    ({"samples": 0}, r"sweep.samples: Input should be greater than 0"),
    ({"samples": "2"}, r"sweep.samples: Input should be a valid integer"),
    ({"samples": 2, "temperature": [0.0, 0.8]}, r"samples = 2 needs every temperature > 0"),
    ({"run": {"method": "replay", "verification": "probabilistic"}},
     r'method "replay" at temperature 0.9 needs verification = "target-only"'),
])
def test_configs_that_would_not_measure_a_sampled_row_are_refused(tmp_path, pair, sweep, message):
    with pytest.raises(ConfigError, match=message):
        load_routed_config(sampled_config(tmp_path / "c.toml", *pair, **sweep))
