# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Calibrate a target + speculator pair, then read the tables and plots
#
# A sweep config names the dataset, the target, its speculators and the draft lengths k; `execute` replays
# the dataset through each pair and stores raw acceptance counts in DuckDB. Runs are resumable: after
# `make quickstart` this notebook measures nothing twice and goes straight to the tables.
#
# Open it with `jupytext --to notebook notebooks/01_calibrate_a_pair.py` (or Jupyter with jupytext). The
# config and store default to the quickstart's; `CALIBRATE_NOTEBOOK_CONFIG` / `CALIBRATE_NOTEBOOK_DB`
# point it elsewhere (the tests do, with a tiny model).

# %%
import os
from pathlib import Path

CONFIG = Path(os.environ.get("CALIBRATE_NOTEBOOK_CONFIG", "../examples/quickstart.toml"))
DB = Path(os.environ.get("CALIBRATE_NOTEBOOK_DB", "../tables/quickstart.duckdb"))
PLOTS = Path(os.environ.get("CALIBRATE_NOTEBOOK_OUT", "../tables")) / "notebook-plots"

# %% [markdown]
# ## Measure
# The config is validated before any model loads; `dtype = "auto"` (the default) computes in bf16 only where
# the hardware does so natively, and says why.

# %%
from calibrate.config import load_config
from calibrate.runner import execute

config = load_config(CONFIG)
print(f"target {config.pairs[0].target}; speculators {[s.kind for s in config.pairs[0].speculators]}; "
      f"k = {config.sweep.k}")
summary = execute(config, DB)
print(f"measured {summary.measured} request(s), {summary.resumed} already stored, {summary.tokens} target tokens "
      f"in {summary.seconds:.1f} s")

# %% [markdown]
# ## Read the table
# One record per (target, speculator, k, thinking, temperature, dataset): pooled AL (total emitted tokens /
# verification steps, vLLM's convention) with a 95% bootstrap CI clustered by conversation, and the macro
# AL (mean of per-request AL).

# %%
from calibrate.tables import query
from calibrate.tables.store import connect

con = connect(DB, read_only=True)
try:
    records = query.load_records(con, query.Filters(run_ids=tuple(summary.run_ids)), n_boot=200)
finally:
    con.close()
print(f"{'speculator':<36} {'k':>2} {'AL':>6}  {'95% CI':<12} macro")
for r in records:
    print(f"{r.speculator:<36} {r.k:>2} {r.acceptance_length:6.3f}  "
          f"{r.interval:<12} {r.macro_acceptance_length:.3f}")  # "n too small" under 10 conversations
assert records, "the run stored nothing"
assert all(1.0 <= r.acceptance_length <= r.k + 1 for r in records)  # AL counts the bonus token

# %% [markdown]
# The same table as `calibrate show` prints it:

# %%
from calibrate.tables.commands import print_table

print_table(DB, run_ids=summary.run_ids, n_boot=200)

# %% [markdown]
# ## Plots
# AL against k per speculator, the unconditional acceptance rate per draft position, and what each
# proposed draft is worth (`calibrate report` writes the same files).

# %%
from IPython.display import Image, display

from calibrate.tables.report import plot

for path in plot(records, PLOTS, force=True):  # the notebook regenerates its plots on every run
    print(path)
    display(Image(filename=str(path)))
