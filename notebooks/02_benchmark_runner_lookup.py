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
# # A benchmark runner: pick the calibrated AL, write each engine's setting
#
# A serving benchmark replays synthetic text, so it forces the engine to a calibrated acceptance length.
# The runner asks the lookup API for (model, speculator, k, thinking) and writes the setting each engine
# reads: SGLang's environment, vLLM's `--speculative-config`, TensorRT-LLM's forced accept count, ATOM's
# and llama.cpp's arguments. It needs no database on the benchmark machine: an exported JSON table answers
# the same way.

# %%
import os
from pathlib import Path

DB = Path(os.environ.get("CALIBRATE_NOTEBOOK_DB", "../tables/quickstart.duckdb"))
OUT = Path(os.environ.get("CALIBRATE_NOTEBOOK_OUT", "../tables")) / "engine-settings"
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## What the table measured
# The catalog lists every measured key; a runner usually knows its model and k, here we take them from it.

# %%
from calibrate.consumers.lookup import DuckDBTable

catalog = DuckDBTable(DB).catalog()
for entry in catalog[:12]:
    print(entry.target, entry.speculator, entry.k, entry.thinking, entry.temperature)
MODEL = catalog[0].target
SPECULATOR = catalog[0].speculator
measured_k = sorted({e.k for e in catalog if e.speculator == SPECULATOR})
K = 3 if 3 in measured_k else measured_k[-1]
print(f"\nbenchmark: {MODEL} with {SPECULATOR}, k = {K} (measured k: {measured_k})")

# %% [markdown]
# ## Look it up
# Model names match as users write them (a hub id or its last part). A key that was not measured is an
# error naming what was, never a silent default.

# %%
from calibrate import lookup

record = lookup(MODEL, SPECULATOR, K, "off", table=DB)
print(f"AL = {record.value()} (95% CI {record.interval}, {record.requests} requests, "
      f"{record.conversations} conversations)")
print("per-position acceptance rates:", [round(x, 3) for x in record.rates])

try:
    lookup(MODEL, SPECULATOR, max(measured_k) + 50, "off", table=DB)
except LookupError as exc:
    print("as expected:", exc)

# %% [markdown]
# ## Each engine's setting

# %%
from calibrate.consumers import LOOKUP_FORMATS, other_algorithm, render_lookup

# Every consumer with a lookup form whose engine runs this speculator as measured, as `calibrate lookup --format
# FORM` prints it (another engine's is refused unless forced: SGLang's NGRAM is not our n-gram).
kind = record.speculator.partition(":")[0]
settings = {form: render_lookup(record, form) for form, c in LOOKUP_FORMATS.items()
            if c is not None and (c.serves is None or kind in c.serves) and other_algorithm(c, record) is None}
for name, text in settings.items():
    (OUT / name).write_text(text if text.endswith("\n") else text + "\n")
    print(f"--- {OUT / name}\n{text.strip()}")

# %% [markdown]
# ## The same answer from an export
# `calibrate export --to json` writes a table a benchmark machine can carry without DuckDB.

# %%
from calibrate import consumers
from calibrate.tables import query
from calibrate.tables.store import connect

con = connect(DB, read_only=True)
try:
    records = query.load_records(con, n_boot=200)
finally:
    con.close()
exported = OUT / "acceptance.json"
consumers.export(records, "json", exported, force=True)  # the notebook regenerates it on every run
again = lookup(MODEL, SPECULATOR, K, "off", table=exported)
print(f"from {exported.name}: AL = {again.value()}")
assert again.value() == record.value()
