"""Tokenize a rendered prompt in memory bounded by its budget, not by the size of its text.

A prompt is left-truncated to `context_tokens`, but tokenizing the whole text first costs the tokenizer
about 150 bytes per character (Qwen2.5's, measured: ids, offsets, token strings, alignments): a 50 MB
prompt took 18.6 GB. Here a long text is tokenized in chunks of at most CHUNK_CHARS characters, from its
end: chunks are taken until they hold the `keep` tokens the budget asks for, and the rest is only counted
(the count is the prompt's length before truncation, which the store records), chunk by chunk.

Chunks must add up to the whole text's tokenization exactly. A tokenizer's pre-tokenizer (the regex that
splits words, numbers and whitespace), its added tokens (`<|im_start|>`) and its merges all look at
neighbouring characters, so a chunk may not be cut just anywhere: a split point is a token boundary p where
cutting changes nothing, checked by tokenizing a window of SPLIT_REACH characters on each side of p whole
and as its two halves, which must give the same tokens; where the tokenizer's pre-tokenizer cuts the text
into pieces (words, numbers, runs of punctuation), p must also fall between two pieces, which merges never
cross. Effects of a cut reach a pre-token or so (a few
characters); a text with no such point for many characters (one enormous word) falls back to a longer
chunk. tests/test_prompt_tokens.py checks the chunked tail and count against the whole tokenization of the
real trajectories' prompts, with chunks small enough to cut every prompt hundreds of times.

A tokenizer without offsets (a slow, pure-Python one) tokenizes the whole text, as it always did; the row
caps of calibrate.limits bound that text.
"""

from __future__ import annotations

from typing import Any

CHUNK_CHARS = 1 << 18  # characters tokenized at once: about 40 MB of tokenizer memory
SPLIT_REACH = 1 << 9  # characters each side of a split point that must tokenize alike cut or whole
SPLIT_TRIES = 8  # boundaries tried per window, nearest the wanted point first


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """The text's token ids as the engines see them: no BOS / EOS added (the chat template has its own)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tail_tokens(tokenizer: Any, text: str, keep: int) -> tuple[list[int], int]:
    """The last `keep` tokens of `text` and how many tokens the whole text has, equal to
    `token_ids(text)[-keep:]` and `len(token_ids(text))`, in memory of at most a chunk and `keep` ids."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if len(text) <= CHUNK_CHARS or not splits(tokenizer):
        ids = token_ids(tokenizer, text)
        return ids[-keep:], len(ids)
    tail: list[int] = []
    total, end = 0, len(text)
    while end > 0:
        start = chunk_start(tokenizer, text, end)
        ids = token_ids(tokenizer, text[start:end])
        total += len(ids)
        if len(tail) < keep:
            tail = ids[max(0, len(ids) - (keep - len(tail))):] + tail
        end = start
    return tail, total


def count_tokens(tokenizer: Any, text: str) -> int:
    """`len(token_ids(text))`, in memory of a chunk."""
    return tail_tokens(tokenizer, text, 1)[1]


PROBE = "def f(x):\n    return x + 1  # one line of code\n" * 24


def splits(tokenizer: Any) -> bool:
    """Whether the tokenizer can be cut at all: it gives offsets (a fast tokenizer), and a text of plain lines
    has a split point. One that prepends a marker to every text it is given (SentencePiece's "▁" in Llama 2's
    normalizer) has none, and tokenizes whole texts."""
    if not getattr(tokenizer, "is_fast", False):
        return False
    return split_point(tokenizer, PROBE, len(PROBE) // 2, widen=1) is not None


def chunk_start(tokenizer: Any, text: str, end: int) -> int:
    """Where the chunk that ends at `end` starts: 0 when the text before `end` fits in one chunk, else a split
    point about CHUNK_CHARS / 2 to CHUNK_CHARS before `end`, or further back where the text has none there (a
    run of one character longer than the windows: the chunk then holds the run)."""
    wanted = end - CHUNK_CHARS * 3 // 4
    while end > CHUNK_CHARS and wanted > 0:
        point = split_point(tokenizer, text, wanted)
        if point is not None and point < end:
            return point
        wanted -= CHUNK_CHARS // 4
    return 0


def split_point(tokenizer: Any, text: str, wanted: int, widen: int = 3) -> int | None:
    """A point near `wanted` where the text can be cut without changing a token, or None where none of the
    nearest SPLIT_TRIES candidates is one in any of `widen` windows, SPLIT_REACH wide each side and 4 times
    wider each next.

    A candidate is a token boundary that is also a boundary of the pre-tokenizer's pieces (which merges never
    cross; inside one long piece, a run of "=" say, a cut would shift every token after it, and a window
    lying inside the run could not tell) and falls between two different characters; it is taken when the
    window around it tokenizes to the same ids whole and cut there."""
    for reach in (SPLIT_REACH * 4**i for i in range(widen)):
        low, high = max(0, wanted - reach), min(len(text), wanted + reach)
        window = text[low:high]
        encoded = tokenizer(window, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        margin = reach // 4  # never at a window's own edge, where its cut shows
        edges = {edge for start, end in encoded["offset_mapping"] for edge in (start, end)
                 if margin <= edge <= len(window) - margin and window[edge - 1] != window[edge]}
        edges &= piece_edges(tokenizer, window, edges)
        for edge in sorted(edges, key=lambda e: (abs(low + e - wanted), e))[:SPLIT_TRIES]:
            if token_ids(tokenizer, window[:edge]) + token_ids(tokenizer, window[edge:]) == ids:
                return low + edge
    return None


def piece_edges(tokenizer: Any, window: str, default: set[int]) -> set[int]:
    """The boundaries of the pre-tokenizer's pieces of `window`, or `default` where there are no pieces to
    speak of: no pre-tokenizer, or one that does not cut even plain lines of code (Gemma's splits at spaces,
    but its normalizer has turned them into "▁" before). Pieces are of the normalized text, as the tokenizer
    cuts them, unless the normalizer changes the text's length (the boundaries would shift): then of the text
    as given, and the check of each cut decides alone."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None or len(pre.pre_tokenize_str(_normalized(backend, PROBE))) <= 1:
        return default
    return {edge for _, (start, end) in pre.pre_tokenize_str(_normalized(backend, window)) for edge in (start, end)}


def _normalized(backend: Any, text: str) -> str:
    normalizer = getattr(backend, "normalizer", None)
    normalized = normalizer.normalize_str(text) if normalizer is not None else text
    return normalized if len(normalized) == len(text) else text
