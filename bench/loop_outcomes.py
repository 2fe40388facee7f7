"""Every outcome of a fixed set of loops, written to JSON, and two such files compared: the check that a
change to the loop leaves its counts to the bit.

The set: a tiny random pair (a peaky target and a perturbed copy as its draft) and SmolLM2-135M (a
perturbed copy as its draft), each with the draft model, n-gram, suffix and a model-free speculator that
samples its drafts; T = 0.7 (top-p 0.9) and T = 1.0 (top-p 0.95) under both verification rules, and T = 0;
1 and 5 loops per batch; k = 1, 2, 4, 6; 3 prompts each: 960 outcomes. Then the heads that read the
target's hidden states: SmolLM2's distilled EAGLE-3 head and the tiny DeepSeek MTP model, at T = 0.7 and 0
(96 more). An outcome is the tokens, the finish reason and every segment's counts, the analytic expectation
as the exact bits of its float.

    python bench/loop_outcomes.py --out before.json            # on the old tree
    python bench/loop_outcomes.py --out after.json --compare before.json

Needs the built test models (`make models`); one thread, about 10 minutes on a 2-core Xeon.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibrate.models import load_model  # noqa: E402
from calibrate.replay.loop import LoopLayout, LoopSettings, LoopWatch, run_loops  # noqa: E402
from calibrate.speculators.base import BuildContext, Proposal  # noqa: E402
from calibrate.speculators.draft_model import DraftModelSpeculator  # noqa: E402
from calibrate.speculators.ngram import NgramSpeculator  # noqa: E402
from calibrate.speculators.per_loop import Proposer  # noqa: E402
from calibrate.speculators.registry import speculator_kind  # noqa: E402
from calibrate.speculators.suffix import SuffixSpeculator  # noqa: E402
from calibrate.terms import Sampling  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402

MODELS = Path(os.environ.get("CALIBRATE_TEST_MODELS", Path.home() / ".cache" / "calibrate-test-models"))
SETTINGS = [(0.7, 0.9, "probabilistic"), (0.7, 0.9, "target-only"), (0.0, None, "probabilistic"),
            (1.0, 0.95, "probabilistic"), (1.0, 0.95, "target-only")]
HEAD_SETTINGS = [SETTINGS[0], SETTINGS[2]]
KS = [1, 2, 4, 6]
TEXTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "ls -la /testbed && cat setup.py | grep version",
         "Fix the failing test in tests/test_io.py: the reader drops the last line."]


class Sampler(Proposer):
    """Drafts uniformly at random with the loop's generator and says so (q uniform)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    @property
    def name(self) -> str:
        return "sampler"

    def propose(self, context, k, temperature=0.0, generator=None) -> Proposal:
        tokens = torch.randint(0, self.vocab, (k,), generator=generator).tolist()
        return Proposal(tokens=tokens, probs=torch.full((k, self.vocab), 1 / self.vocab))


def labeller(tokens: list[int]) -> list[str]:
    return ["thinking" if i < 5 else ("tool_call" if t % 7 == 0 else "answer") for i, t in enumerate(tokens)]


def perturbed(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    copied = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = copied.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * w.std() * scale)
    return copied


def outcome(result, k: int) -> dict:
    counts = result.counts[k]
    return {"tokens": result.tokens[k], "finish": result.finish_reason[k], "k": counts.k,
            "segments": {name: {"hist": seg.hist.tolist(), "tokens": seg.tokens, "censored": seg.censored_steps,
                                "expected": None if seg.expected_accepted is None
                                else float(seg.expected_accepted).hex(),
                                "drafted": seg.drafted_tokens, "empty": seg.empty_steps}
                         for name, seg in sorted(counts.segments.items())}}


def run_set(name: str, target, specs, prompts, eos, out: dict, settings, max_new: int) -> None:
    for temperature, top_p, rule in settings:
        for rows in (1, 5):
            loop_settings = LoopSettings(Sampling(temperature, top_p, None, 7), max_new, eos, verification=rule)
            layout = LoopLayout(KS, loop_rows=rows, request_keys=[100 + i for i in range(len(prompts))])
            results = run_loops(target, specs, prompts, loop_settings, layout, LoopWatch(labeller=labeller))
            for spec, per_request in zip(specs, results, strict=True):
                for i, result in enumerate(per_request):
                    for k in KS:
                        key = f"{name}|{spec.name}|T={temperature}|p={top_p}|{rule}|rows={rows}|req={i}|k={k}"
                        out[key] = outcome(result, k)
            print(f"{name} T={temperature} {rule} rows={rows}: {len(out)} outcomes", flush=True)


def chat_prompts(tokenizer) -> list[list[int]]:
    out = []
    for text in TEXTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"]) if isinstance(ids, dict) else list(ids))
    return out


def collect() -> dict:
    out: dict = {}
    tiny = tiny_llama(seed=0)
    with torch.no_grad():
        tiny.lm_head.weight.mul_(30.0)  # peaky: runs and acceptances are non-trivial
    specs = [DraftModelSpeculator.of_model(perturbed(tiny, 5, 0.6)),
             NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1), SuffixSpeculator(), Sampler(97)]
    run_set("tiny", tiny, specs, [[1, 5, 9, 13, 2, 7], [5, 3], [4, 5, 6, 7, 4, 5, 6, 7, 4, 5] * 2], {96}, out,
            SETTINGS, max_new=24)
    smol = load_model(str(MODELS / "smollm2-135m-instruct"), "float32", "cpu")
    prompts = chat_prompts(smol.tokenizer)
    specs = [DraftModelSpeculator.of_model(perturbed(smol.model, 3, 0.3)), NgramSpeculator(), SuffixSpeculator(),
             Sampler(smol.model.config.vocab_size)]
    run_set("smol", smol.model, specs, prompts, smol.eos_token_ids, out, SETTINGS, max_new=16)
    for kind, target_name, head in (("eagle3", "smollm2-135m-instruct", "smollm2-135m-instruct-eagle3"),
                                    ("mtp", "tiny-deepseek-mtp", None)):
        target = smol if kind == "eagle3" else load_model(str(MODELS / target_name), "float32", "cpu")
        cls = speculator_kind(kind)
        spec = cls.config_model(kind=kind, **({"model": str(MODELS / head)} if head else {}))
        built = cls.build(spec, BuildContext(dtype="float32", device="cpu", batch_size=4, target=target))
        run_set(f"smol-{kind}" if kind == "eagle3" else kind, target.model, [built], prompts,
                target.eos_token_ids, out, HEAD_SETTINGS, max_new=16)
    return out


def compare(now: dict, before: dict) -> int:
    """Prints every outcome that differs or is missing on one side; returns how many."""
    bad = 0
    for key in sorted(set(now) | set(before)):
        if now.get(key) != before.get(key):
            bad += 1
            if bad <= 10:
                print(f"differs: {key}\n  before {before.get(key)}\n  now    {now.get(key)}")
    print(f"{len(now)} outcomes now, {len(before)} before: {bad} differ")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write this tree's outcomes (JSON)")
    parser.add_argument("--compare", type=Path, help="an earlier tree's outcomes to compare with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    now = collect()
    args.out.write_text(json.dumps(now, sort_keys=True))
    print(f"{len(now)} outcomes -> {args.out}")
    if args.compare:
        sys.exit(1 if compare(now, json.loads(args.compare.read_text())) else 0)


if __name__ == "__main__":
    main()
