"""The bounds every input is held to, in one place: what the store's integer columns, the engines and memory
hold.

A value beyond them would not fail at once but later, and worse: DuckDB's own `Conversion Error` for a k or a
budget past its 32-bit INTEGER columns, a `MemoryError` an hour into a sweep for `samples = 1e9`, an
`OverflowError` from the socket layer for a timeout of 1e300 s, a Rust tokenizer aborting on a 50 MB line.
So the config refuses them when it is read (calibrate.config, naming the key), the CLI refuses its options
(`--bootstrap`, `--seed`), and the dataset readers turn an oversized or too deeply nested row into a problem
record of its own (calibrate.data.sources, calibrate.data.loader). docs/configuration.md, "Bounds on inputs", lists them.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1  # DuckDB INTEGER: the store's token counts, top_k, turn, sample

# Token budgets ([dataset] context_tokens, max_new_tokens): beyond every model's context (10M tokens is the
# longest served today), and their sum stays inside the store's INTEGER columns.
MAX_TOKENS = 2**24

# Seeds ([dataset] seed, `--seed` of show / export / lookup / report): what every consumer of one takes.
# vLLM's --seed seeds numpy's legacy generator (0..2^32 - 1), llama.cpp's is a uint32.
MAX_SEED = 2**32 - 1

# Responses sampled per request at T > 0 ([sweep] samples): each is a row per run, planned in memory.
MAX_SAMPLES = 1000

# Requests in one engine batch ([run] batch_size) or in flight to a server ([pairs.server] concurrency):
# vLLM's --max-num-seqs and llama.cpp's --parallel take the latter, and one thread serves each.
MAX_BATCH = 4096

# Seconds a server may take to start or to answer one request ([pairs.server] startup_timeout,
# request_timeout): a week; the socket layer overflows past what its time type holds.
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0

# Bootstrap replicates (`--bootstrap`): each keeps (k + 1) floats per statistic in memory while the
# percentiles are taken; 100,000 is 50 times the default and far past where the interval stops moving.
MAX_BOOTSTRAP = 100_000

# Dataset rows. A row (a JSONL line's bytes; for other files, the characters of the row's text) over
# MAX_ROW_BYTES, a message over MAX_MESSAGE_CHARS characters (content, reasoning and tool-call arguments), or
# nesting deeper than MAX_NESTING (objects and lists, in the row or in a tool call's JSON arguments) is a
# problem record, never a crash. 16 MiB holds a whole trajectory of a million-token agent; the largest of the
# 167 real mini-swe-agent trajectories is 0.6 MB. No real row nests past a few dozen.
MAX_ROW_BYTES = 16 * 2**20
MAX_MESSAGE_CHARS = 4 * 2**20
MAX_NESTING = 100
