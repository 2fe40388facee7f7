"""`calibrate run --plan`: the measurement plan in lines, numbered as a run's progress lines name them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from calibrate.plan import Measurement
from calibrate.prepared import Previewed
from calibrate.speculators.registry import KINDS


def print_plan(console: Console, previewed: Sequence[Previewed], db: Path | None) -> None:
    runs = sum(len(p.measurement.runs) for p in previewed)
    rows = sum(p.rows for p in previewed)
    stored = sum(p.stored or 0 for p in previewed)
    console.print(f"plan: {len(previewed)} measurement(s), {runs} run(s), {rows} row(s) (responses x runs); "
                  f"{stored} already in {db}", highlight=False, soft_wrap=True)
    for number, p in enumerate(previewed, 1):
        m = p.measurement
        console.print(f"[bold][{number}/{len(previewed)}][/bold] {escape(m.label)}", highlight=False, soft_wrap=True)
        for line in _details(m):
            console.print(f"      {escape(line)}", highlight=False, soft_wrap=True)
        if p.stored is None:
            held = "run ids known at launch (a hub model's revision): what is stored is told when the run starts"
        else:
            held = f"{p.stored} of {p.rows} rows in {db}" + (": skipped" if p.stored else "")
        console.print(f"      stored: {escape(held)}", highlight=False, soft_wrap=True)


def _details(m: Measurement) -> list[str]:
    s = m.sampling
    sampling = (f"T={s.temperature:g}" + (f" top_p={s.top_p:g}" if s.top_p is not None else "")
                + (f" top_k={s.top_k}" if s.top_k is not None else "") + f" seed={s.seed}, {m.samples} sample(s)"
                if s.temperature > 0 else "T=0 (greedy)")
    servers = "; ".join(server.describe() for server in m.servers) or "none (this process)"
    return [f"source: {m.source}; scorer: {m.scorer} (stored as method {m.method!r}); sampling: {sampling}",
            f"servers: {servers}", f"the pair loads here: {_loads(m)}"]


VIEWS = {"whole": "the target", "mtp": "the target's MTP view", "embeddings": "the target's embeddings"}


def _loads(m: Measurement) -> str:
    """What this process loads for the measurement's pair (calibrate.plan.Loads), by name."""
    loads, specs = m.loads, m.settings.speculators

    def names(indices: tuple[int, ...]) -> str:
        return ", ".join(KINDS[specs[i].kind].config_name(specs[i], m.target) for i in indices)

    parts = [f"{VIEWS[loads.target]} ({loads.weights})"] if loads.target else []
    parts += [f"speculators {names(loads.scored)}"] if loads.scored else []
    parts += [f"audit twins of {names(loads.twinned)}"] if loads.twinned else []
    parts += [f"hidden states {'from ' + m.backend if loads.features == 'engine' else 'computed here'}"] \
        if loads.features else []
    return "; ".join(parts) or "nothing (the server measures alone)"
