"""Step times of a dense target and its draft model per (k, batch size): the CSV `--cost` takes for the best k.

    python bench/step_cost.py --target CONFIG.json --draft CONFIG.json [--context 12288] [--batch-sizes 1,8,32,64]
        [--ks 1,...,8] [--repeats 50] --out steps.csv

A speculative step at k is k draft passes of one position and a target pass over k + 1 positions; plain
decoding is a target pass over one position. This times those passes for transformer shapes read from two
Hugging Face config.json files (a Qwen2 / Llama-style decoder: GQA attention over a KV cache of `--context`
tokens per sequence, its query heads grouped onto their KV head so the cache is read once, SwiGLU MLP, RMSNorm, an untied LM head on every position fed), with random bf16 weights,
each pass captured once in a CUDA graph and replayed (`--repeats` times, CUDA events): the weight and cache
reads that make decoding memory-bound, without a serving engine's scheduler or sampler. Rotary embedding is
left out (elementwise, small next to the reads). The CSV's step_time(k, B) = target(k + 1, B) + k draft(1, B),
k = 0 the plain step; `raw` beside it holds each pass's time. On a machine without CUDA it times eagerly (a
smoke test, not a figure).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, path: Path) -> Shape:
        c = json.loads(path.read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                   c["num_key_value_heads"], head_dim, c["vocab_size"])


class Decoder:
    """Weights and a KV cache of `context` tokens for `batch` sequences; `step(q)` feeds q new positions each."""

    def __init__(self, s: Shape, batch: int, context: int, max_q: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        dt = torch.bfloat16

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dt)

        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.s, self.context = s, context
        self.layers = [dict(qkv=w(s.hidden, qkv), qkv_b=w(qkv), o=w(s.heads * s.head_dim, s.hidden),
                            gate_up=w(s.hidden, 2 * s.intermediate), down=w(s.intermediate, s.hidden),
                            k=w(batch, s.kv_heads, context + max_q, s.head_dim),
                            v=w(batch, s.kv_heads, context + max_q, s.head_dim)) for _ in range(s.layers)]
        self.head = w(s.hidden, s.vocab)
        self.embed = w(s.vocab, s.hidden)
        self.batch, self.device = batch, device

    def step(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids (B, q): write q positions' K/V after the cached context, attend causally, logits (B, q, vocab)."""
        s, q = self.s, ids.shape[1]
        x = self.embed[ids]
        for layer in self.layers:
            h = F.rms_norm(x, (s.hidden,))
            qkv = h @ layer["qkv"] + layer["qkv_b"]
            qh, kh, vh = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            group = s.heads // s.kv_heads  # the query heads sharing one KV head attend as one head's rows
            qh = qh.view(self.batch, q, s.kv_heads, group, s.head_dim).permute(0, 2, 3, 1, 4)
            qh = qh.reshape(self.batch, s.kv_heads, group * q, s.head_dim)
            layer["k"][:, :, self.context:self.context + q] = kh.view(self.batch, q, s.kv_heads, s.head_dim).transpose(1, 2)
            layer["v"][:, :, self.context:self.context + q] = vh.view(self.batch, q, s.kv_heads, s.head_dim).transpose(1, 2)
            k, v = layer["k"][:, :, :self.context + q], layer["v"][:, :, :self.context + q]
            a = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask.repeat(group, 1))
            a = a.view(self.batch, s.kv_heads, group, q, s.head_dim).permute(0, 3, 1, 2, 4)
            x = x + a.reshape(self.batch, q, -1) @ layer["o"]
            gate, up = (F.rms_norm(x, (s.hidden,)) @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        return F.rms_norm(x, (s.hidden,)) @ self.head


def timed(model: Decoder, q: int, repeats: int) -> float:
    """Milliseconds of one pass of q positions per sequence (a CUDA graph replayed; eager without CUDA)."""
    ids = torch.randint(0, model.s.vocab, (model.batch, q), device=model.device)
    total = model.context + q
    mask = torch.ones(q, total, dtype=torch.bool, device=model.device).tril(diagonal=model.context)
    if model.device.type != "cuda":
        model.step(ids, mask)
        start = time.perf_counter()
        for _ in range(repeats):
            model.step(ids, mask)
        return (time.perf_counter() - start) * 1e3 / repeats
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model.step(ids, mask)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.step(ids, mask)
    for _ in range(3):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return begin.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--context", type=int, default=12288)
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ks = [int(k) for k in args.ks.split(",")]
    rows, raw = [], []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        target = Decoder(Shape.of(args.target), batch, args.context, max(ks) + 1, device)
        t = {q: timed(target, q, args.repeats) for q in (1, *(k + 1 for k in ks))}
        del target
        draft_model = Decoder(Shape.of(args.draft), batch, args.context, 1, device)
        d = timed(draft_model, 1, args.repeats)
        del draft_model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append((0, batch, t[1]))
        rows += [(k, batch, t[k + 1] + k * d) for k in ks]
        raw += [("target", batch, q, ms) for q, ms in t.items()] + [("draft", batch, 1, d)]
        print(f"B={batch}: target q=1 {t[1]:.3f} ms, q={max(ks) + 1} {t[max(ks) + 1]:.3f} ms, draft {d:.3f} ms",
              flush=True)
    with args.out.open("w", newline="") as f:
        csv.writer(f).writerows([("k", "batch_size", "step_time"), *rows])
    with args.out.with_name(args.out.stem + "-raw.csv").open("w", newline="") as f:
        csv.writer(f).writerows([("model", "batch_size", "positions", "ms"), *raw])
    print(f"wrote {args.out} ({device}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"context {args.context})")


if __name__ == "__main__":
    main()
