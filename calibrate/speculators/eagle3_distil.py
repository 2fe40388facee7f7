"""Distil a small EAGLE-3 head for a target on agentic traffic, on the CPU in minutes.

No public EAGLE-3 head is reachable from the test machines, and a random head accepts nothing, so tests
and the quickstart-sized tables need one made here. Recipe (EAGLE-3's, shortened):
- text: rendered agentic conversations (the last turn of each, so earlier actions and tool output are in
  it), skipping the first `skip` conversations so that measurements on those stay held out;
- one target pass per sequence gives the aux hidden states and the target's greedy token at every position;
- the draft vocabulary is the `draft_vocab` tokens the target predicts most often (d2t offsets as speculators'
  `build_vocab_mappings_from_distribution`);
- training-time test: every depth of the chain is trained (Eagle3Head.chain_logits, teacher-forced), with
  cross-entropy against the target's greedy token, which is what greedy acceptance checks.

    python -m calibrate.speculators.eagle3_distil --target smollm2-135m-instruct \
        --dataset ../shared/datasets/mini-swe-agent-gemini3pro-swebv/original --out DIR --seconds 240
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch

from calibrate.data import cut_turns, load_conversations, render_prompt
from calibrate.models import LoadedModel, load_model
from calibrate.speculators.eagle3_head import Eagle3Head, new_head, save_head


def training_sequences(target: LoadedModel, dataset: str, fmt: str | None, skip: int, count: int,
                       length: int) -> list[list[int]]:
    """The last `length` tokens of the last turn's prompt of conversations skip .. skip + count - 1."""
    loaded = load_conversations(dataset, fmt)
    out = []
    for conversation in loaded.conversations[skip:skip + count]:
        requests = cut_turns([conversation])
        if requests:
            out.append(render_prompt(requests[-1], target.tokenizer, thinking="off", context_tokens=length,
                                     model_name=target.name).ids)
    return out


@torch.inference_mode()
def target_pass(model: torch.nn.Module, tokens: list[int], aux: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The aux hidden states (float32) and the target's greedy token at every position of one sequence."""
    out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return [out.hidden_states[i][0].float() for i in aux], out.logits[0].argmax(-1)


def draft_vocabulary(greedy: list[torch.Tensor], target_vocab: int, size: int) -> torch.Tensor:
    """The `size` target ids the target predicts most often (ties and the remainder by id), sorted."""
    counts = Counter(int(t) for g in greedy for t in g)
    chosen = [t for t, _ in counts.most_common(size)]
    chosen += sorted(set(range(target_vocab)) - set(chosen))[:size - len(chosen)]
    return torch.tensor(sorted(chosen))


def train_head(head: Eagle3Head, examples: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]], *,
               depth: int, window: int, lr: float, steps: int | None = None, seconds: float | None = None,
               log=print) -> None:
    """Train every depth of the chain on (tokens, aux hidden states, target's greedy token) examples."""
    to_draft = torch.full((head.cfg.target_vocab_size,), -100, dtype=torch.long)
    to_draft[head.to_target(torch.arange(head.cfg.draft_vocab_size))] = torch.arange(head.cfg.draft_vocab_size)
    head.embed_tokens.weight.requires_grad_(False)  # the target's own embeddings stay as they are
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    head.train()
    started, step = time.perf_counter(), 0
    while (steps is None or step < steps) and (seconds is None or time.perf_counter() - started < seconds):
        tokens, feats, greedy = examples[step % len(examples)]
        lo = int(torch.randint(0, max(1, len(tokens) - window), ()))
        tokens, greedy, feats = tokens[lo:lo + window], greedy[lo:lo + window], [f[lo:lo + window] for f in feats]
        anchors = torch.arange(0, len(tokens) - 2)
        loss = torch.zeros(())
        for j, logits in enumerate(head.chain_logits(tokens, feats, anchors, depth)):
            # depth j from anchor a predicts the token after position a + 1 + j: the target's greedy choice there
            where = anchors + 1 + j
            labels = to_draft[greedy[where.clamp(max=len(tokens) - 1)]].masked_fill(where > len(tokens) - 1, -100)
            loss = loss + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100) * 0.8 ** j
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 20 == 0:
            log(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f}s)")
    head.eval()


def distil(target: LoadedModel, sequences: list[list[int]], *, draft_vocab: int = 2048, depth: int = 3,
           seconds: float = 240.0, window: int = 256, lr: float = 2e-3, intermediate_size: int = 768,
           seed: int = 0, log=print) -> tuple[Eagle3Head, tuple[int, ...]]:
    torch.manual_seed(seed)
    head, aux = new_head(target.model.config, target.model.get_input_embeddings(), draft_vocab_size=draft_vocab,
                         intermediate_size=intermediate_size)
    examples = [(torch.tensor(s), *target_pass(target.model, s, aux)) for s in sequences]
    vocab = draft_vocabulary([g for *_, g in examples], target.model.config.vocab_size, draft_vocab)
    head.d2t.copy_(vocab - torch.arange(draft_vocab))
    with torch.no_grad():  # start from the target's own output space
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[vocab])
        head.norm.weight.copy_(target.model.get_decoder().norm.weight)
    train_head(head, examples, depth=depth, window=window, lr=lr, seconds=seconds, log=log)
    return head, aux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--format", default="mini-swe-agent")
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip", type=int, default=8, help="conversations held out for measurements")
    parser.add_argument("--count", type=int, default=12)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if (out / ".complete").exists():
        print(f"{out} exists")
        return
    target = load_model(args.target, "float32", "cpu")
    sequences = training_sequences(target, args.dataset, args.format, args.skip, args.count, args.length)
    head, aux = distil(target, sequences, draft_vocab=args.draft_vocab, seconds=args.seconds)
    save_head(head, out, aux, verifier=args.target)
    (out / ".complete").touch()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
