"""Distil a small EAGLE-3 head for a target on agentic traffic, on the CPU in minutes.

No public EAGLE-3 head is reachable from the test machines, and a random head accepts nothing, so tests
and the quickstart-sized tables need one made here. Recipe (EAGLE-3's, shortened):
- text: rendered agentic conversations (the last turn of each, so earlier actions and tool output are in
  it), skipping the first `skip` conversations so that measurements on those stay held out;
- the draft vocabulary is the `draft_vocab` most frequent tokens of the training sequences (d2t offsets, as
  speculators' `build_vocab_mappings_from_distribution` builds them from token frequencies);
- one target pass per sequence gives the aux hidden states and the target's logits over the draft vocabulary
  at every position;
- the target's own responses (EAGLE's regenerated data, `--generate N`): greedy answers to the last two turns
  of N held-in conversations, trained on with their prompts. Measured acceptance is on the target's own
  output, which differs from prompt text (a small target's answers loop), so a head trained on prompt text
  alone learns the wrong distribution;
- training-time test: every depth of the chain is trained (Eagle3Head.chain_logits, teacher-forced), with
  cross-entropy against the target's distribution over the draft vocabulary (EAGLE-3's soft labels: on the
  agentic sample they beat the target's greedy token as a hard label, 1.41 against 1.36 AL at k = 2 after
  600 steps, docs/speculators.md);
- a fixed number of steps (warmup then cosine decay), so that every machine, busy or not, builds the same head.

    python -m distil.eagle3 --target smollm2-135m-instruct \
        --dataset ../shared/datasets/mini-swe-agent-gemini3pro-swebv/original --out DIR --steps 400
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from calibrate.data import cut_turns, load_conversations, render_prompt
from calibrate.models import LoadedModel, load_model
from calibrate.replay.responses import generate_responses
from calibrate.speculators.eagle3_head import Eagle3Head, new_head, save_head


LABELS = ("soft", "greedy")


@dataclass(frozen=True)
class Recipe:
    """Everything besides the target and the dataset that decides the head; saved beside it (distil.json)."""

    skip: int = 8  # the first conversations, held out for measurements
    count: int = 12  # conversations whose last prompt is trained on
    length: int = 512  # tokens of each of those prompts (the last ones)
    generate: int = 0  # conversations whose last two turns the target answers for training
    generate_context: int = 448
    generate_tokens: int = 64
    draft_vocab: int = 2048
    intermediate_size: int = 768
    depth: int = 3  # chain depths trained
    window: int = 512  # tokens per step (a random window of longer sequences)
    steps: int = 400
    labels: str = "soft"  # or "greedy" (train_head)
    lr: float = 2e-3
    seed: int = 0


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


def generated_sequences(target: LoadedModel, dataset: str, fmt: str | None, skip: int, count: int,
                        context: int, new_tokens: int, batch: int = 8) -> list[list[int]]:
    """Prompt + the target's greedy response for the last two turns of conversations skip .. skip + count - 1."""
    loaded = load_conversations(dataset, fmt)
    prompts = [render_prompt(request, target.tokenizer, thinking="off", context_tokens=context,
                             model_name=target.name).ids
               for conversation in loaded.conversations[skip:skip + count]
               for request in cut_turns([conversation])[-2:]]
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        responses = generate_responses(target.model, chunk, max_new_tokens=new_tokens,
                                    eos_token_ids=target.eos_token_ids)
        out += [list(p) + r.tokens for p, r in zip(chunk, responses)]
    return out


@dataclass
class Example:
    """One training sequence with what the target computed over it."""

    tokens: torch.Tensor  # (N,)
    aux: list[torch.Tensor]  # (N, H) float32 each: the inputs of the aux layers
    greedy: torch.Tensor  # (N,): the target's argmax (a target id) at every position
    logits: torch.Tensor  # (N, V_draft) float16: the target's logits at the draft vocabulary's ids


@torch.inference_mode()
def target_pass(model: torch.nn.Module, tokens: list[int], aux: tuple[int, ...], vocab: torch.Tensor) -> Example:
    out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return Example(torch.tensor(tokens), [out.hidden_states[i][0].float() for i in aux], out.logits[0].argmax(-1),
                   out.logits[0][:, vocab].half())


def draft_vocabulary(sequences: list[list[int]], target_vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the sequences (ties and the remainder by id), sorted."""
    counts = Counter(t for s in sequences for t in s)
    chosen = [t for t, _ in counts.most_common(size)]
    chosen += sorted(set(range(target_vocab)) - set(chosen))[:size - len(chosen)]
    return torch.tensor(sorted(chosen))


def warmup_cosine(steps: int, warmup: int = 30):
    """The learning-rate factor at each step: linear warmup, then cosine decay to zero at `steps`."""
    return lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


def train_head(head: Eagle3Head, examples: list[Example], *, depth: int, window: int, lr: float, steps: int,
               labels: str = "soft", seed: int = 0, log=print) -> None:
    """Train every depth of the chain on the examples, visited in a seeded random order, one random window of
    each per step. The examples' logits must be over the head's draft vocabulary, in its order.

    labels: "soft" (the target's distribution over the draft vocabulary) or "greedy" (its argmax, ignored where
    it is outside the draft vocabulary). Soft suits real targets; a tiny random target's near-flat
    distributions teach little, and its argmax is what greedy acceptance checks."""
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {', '.join(LABELS)}, not {labels!r}")
    to_draft = torch.full((head.cfg.target_vocab_size,), -100, dtype=torch.long)
    to_draft[head.to_target(torch.arange(head.cfg.draft_vocab_size))] = torch.arange(head.cfg.draft_vocab_size)
    head.embed_tokens.weight.requires_grad_(False)  # the target's own embeddings stay as they are
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps))
    rng = torch.Generator().manual_seed(seed)
    order: list[int] = []
    head.train()
    started = time.perf_counter()
    for step in range(steps):
        if not order:
            order = torch.randperm(len(examples), generator=rng).tolist()
        example = examples[order.pop()]
        lo = int(torch.randint(0, max(1, len(example.tokens) - window + 1), (), generator=rng))
        tokens, feats = example.tokens[lo:lo + window], [f[lo:lo + window] for f in example.aux]
        if labels == "soft":
            target = example.logits[lo:lo + window].float().softmax(-1)
        else:
            target = to_draft[example.greedy[lo:lo + window]]
        loss = torch.zeros(())
        for j, logits in enumerate(head.chain_logits(tokens, feats, torch.arange(0, len(tokens) - 2), depth)):
            # depth j from anchor a predicts the token after position a + 1 + j: the target's distribution there;
            # anchors whose position runs past the window have no label
            live = min(len(tokens) - 2, len(tokens) - 1 - j)
            loss = loss + torch.nn.functional.cross_entropy(logits[:live], target[1 + j:1 + j + live],
                                                            ignore_index=-100) * 0.8 ** j
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        if (step + 1) % 25 == 0:
            log(f"step {step + 1}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f}s)")
    head.eval()


def distil(target: LoadedModel, sequences: list[list[int]], recipe: Recipe,
           log=print) -> tuple[Eagle3Head, tuple[int, ...]]:
    torch.manual_seed(recipe.seed)
    head, aux = new_head(target.model.config, target.model.get_input_embeddings(),
                         draft_vocab_size=recipe.draft_vocab, intermediate_size=recipe.intermediate_size)
    vocab = draft_vocabulary(sequences, target.model.config.vocab_size, recipe.draft_vocab)
    head.d2t.copy_(vocab - torch.arange(recipe.draft_vocab))
    examples, started = [], time.perf_counter()
    for i, sequence in enumerate(sequences):
        examples.append(target_pass(target.model, sequence, aux, vocab))
        if (i + 1) % 20 == 0 or i + 1 == len(sequences):
            log(f"target passes {i + 1}/{len(sequences)} ({time.perf_counter() - started:.0f}s)")
    with torch.no_grad():  # start from the target's own output space
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[vocab])
        head.norm.weight.copy_(target.model.get_decoder().norm.weight)
    train_head(head, examples, depth=recipe.depth, window=recipe.window, lr=recipe.lr, steps=recipe.steps,
               labels=recipe.labels, seed=recipe.seed, log=log)
    return head, aux


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    return Recipe(**{name: getattr(args, name) for name in Recipe.__dataclass_fields__})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--format", default="mini-swe-agent")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    for name, field in Recipe.__dataclass_fields__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(field.default), default=field.default,
                            choices=LABELS if name == "labels" else None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    recipe = recipe_from_args(args)
    provenance = {"target": args.target, "dataset": args.dataset, **asdict(recipe)}
    made = out / "distil.json"
    if (out / ".complete").exists() and made.exists() and json.loads(made.read_text()) == provenance:
        print(f"{out} exists")
        return
    (out / ".complete").unlink(missing_ok=True)  # made by another recipe (or unfinished): made again
    target = load_model(args.target, "float32", "cpu")
    started = time.perf_counter()
    sequences = training_sequences(target, args.dataset, args.format, recipe.skip, recipe.count, recipe.length)
    if recipe.generate:
        sequences += generated_sequences(target, args.dataset, args.format, recipe.skip, recipe.generate,
                                         recipe.generate_context, recipe.generate_tokens)
        print(f"{len(sequences)} sequences, the target's responses included ({time.perf_counter() - started:.0f}s)")
    head, aux = distil(target, sequences, recipe)
    save_head(head, out, aux, verifier=args.target)
    (out / "distil.json").write_text(json.dumps(provenance, indent=2) + "\n")
    (out / ".complete").touch()
    print(f"wrote {out} in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
