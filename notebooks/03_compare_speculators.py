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
# # Compare speculators, draft lengths and segments, with their uncertainty
#
# Acceptance differs by speculator, by k, and by what the target is writing (thinking, answer text, tool
# calls). Every AL here carries a 95% bootstrap CI clustered by conversation: turns of one conversation are
# not independent, so a CI that ignored that would be too narrow. Two speculators differ only where their
# CIs say so.

# %%
import os
from pathlib import Path

DB = Path(os.environ.get("CALIBRATE_NOTEBOOK_DB", "../tables/quickstart.duckdb"))
PLOTS = Path(os.environ.get("CALIBRATE_NOTEBOOK_OUT", "../tables")) / "notebook-plots"
PLOTS.mkdir(parents=True, exist_ok=True)

# %%
from calibrate.tables import query
from calibrate.tables.store import connect

con = connect(DB, read_only=True)
try:
    overall = query.load_records(con, n_boot=300)
    by_segment = query.load_records(con, segments=True, n_boot=300)
finally:
    con.close()
speculators = sorted({r.speculator for r in overall})
print(f"{len(overall)} keys; speculators: {speculators}")

# %% [markdown]
# ## AL against k, per speculator
# A draft model's AL keeps rising with k while model-free speculators (n-gram, suffix) flatten: they often
# have nothing more to propose.

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 4))
for spec in speculators:
    rows = sorted((r for r in overall if r.speculator == spec), key=lambda r: r.k)
    ks = [r.k for r in rows]
    al = [r.acceptance_length for r in rows]
    # no bar where the CI is withheld (fewer than 10 conversations: record.ci_note)
    err = [[0.0 if r.ci_low is None else r.acceptance_length - r.ci_low for r in rows],
           [0.0 if r.ci_high is None else r.ci_high - r.acceptance_length for r in rows]]
    ax.errorbar(ks, al, yerr=err, marker="o", capsize=3, label=spec)
ax.set_xlabel("draft length k")
ax.set_ylabel("pooled AL (95% CI)")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(PLOTS / "compare_al_vs_k.png", dpi=100)
plt.show()

# %% [markdown]
# ## Which differences are real
# At each k, the best speculator and whether its CI clears the runner-up's.

# %%
for k in sorted({r.k for r in overall}):
    ranked = sorted((r for r in overall if r.k == k), key=lambda r: -r.acceptance_length)
    if len(ranked) < 2:
        continue
    best, second = ranked[0], ranked[1]
    if best.ci_low is None or second.ci_high is None:
        verdict = "too few conversations for intervals: not distinguishable here"
    elif best.ci_low > second.ci_high:
        verdict = "clearly ahead"
    else:
        verdict = "CIs overlap: not distinguishable here"
    print(f"k={k}: {best.speculator} {best.acceptance_length:.3f} [{best.interval}] vs "
          f"{second.speculator} {second.acceptance_length:.3f} [{second.interval}]: {verdict}")

# %% [markdown]
# ## By segment
# Tool calls quote file names and earlier output, so prompt lookup often accepts more there than in prose.

# %%
print(f"{'speculator':<36} {'k':>2} {'segment':<10} {'steps':>6} {'AL':>6}  95% CI")
for r in sorted(by_segment, key=lambda r: (r.speculator, r.k, r.segment)):
    if r.segment == "all":
        continue
    print(f"{r.speculator:<36} {r.k:>2} {r.segment:<10} {r.steps:>6} {r.acceptance_length:6.3f}  "
          f"{r.interval}")
segments_seen = {r.segment for r in by_segment}
assert "all" in segments_seen and len(segments_seen) >= 2, segments_seen
