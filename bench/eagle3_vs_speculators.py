"""Oracle: our EAGLE-3 draft logits vs the `speculators` package's Eagle3DraftModel on the same weights.

    make oracle-env      # pip install --no-deps speculators==0.9.0 into .oracle/speculators (git-ignored)
    PYTHONPATH=.oracle/speculators:. python bench/eagle3_vs_speculators.py

speculators 0.9.0 pins transformers <= 5.19 and pulls training-only dependencies; its model code imports
with transformers 5.24 once those are stubbed (openai, hs_connectors, loguru: used by its data generation and
logging, never by the forward compared here), so it is installed without dependencies rather than in its own
environment. A random head for a tiny Llama target is written in the speculators format by our `save_head`,
loaded by speculators' own `Eagle3DraftModel.from_pretrained` (its embeddings are then set to the target's:
its verifier loader left them at random init in about half the runs here), and both run teacher-forced chains (speculators' TTT forward, our
`Eagle3Head.chain_logits`) over the same tokens and aux hidden states; the maximum absolute difference of
the draft logits is printed per depth, for each norm-flag variant (norm_before_residual, norm_before_fc,
fc_norm, norm_output). `--json` prints the figures for tests/test_eagle3_oracle.py.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
import tempfile
import types
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.conftest

VARIANTS = {
    "plain": {"norm_before_residual": False},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_residual": True, "norm_before_fc": True},
    "fc_norm+norm_output": {"norm_before_residual": False, "fc_norm": True, "norm_output": True},
}


class _Anything:
    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return self


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {}) if name[:1].isupper() else _Anything()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-ins for speculators' training-only imports (see the module docstring)."""

    names = ("openai", "hs_connectors", "loguru")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def compare(flags: dict[str, bool], depth: int = 4, seed: int = 0) -> list[float]:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from calibrate.speculators.eagle3_head import new_head, save_head
    from tests.conftest import tiny_llama

    target = tiny_llama(layers=6, seed=seed)
    torch.manual_seed(seed)
    head, aux = new_head(target.config, target.get_input_embeddings(), draft_vocab_size=64,
                         aux_layer_ids=(1, 3, 4), **flags)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("embed_tokens"):
                p.add_(torch.randn_like(p) * 0.3)
        ids = torch.cat([torch.arange(0, 97, 2), torch.arange(1, 97, 2)])[:64].sort().values
        head.d2t.copy_(ids - torch.arange(64))
    with tempfile.TemporaryDirectory() as tmp:
        target.save_pretrained(f"{tmp}/target")
        save_head(head, Path(f"{tmp}/head"), aux, verifier=f"{tmp}/target")
        config = Eagle3SpeculatorConfig.from_pretrained(f"{tmp}/head")
        config.transformer_layer_config._attn_implementation = "eager"  # dense masks on the CPU
        theirs = Eagle3DraftModel.from_pretrained(f"{tmp}/head", config=config).eval()
    # speculators' verifier loader (load_model_layers) sometimes leaves embed_tokens at its random init for
    # this saved tiny target (seen in about half the runs); both sides must use the target's embeddings.
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    mine = head.state_dict()
    differ = [k for k, v in theirs.state_dict().items() if k in mine and not torch.equal(mine[k], v)]
    if differ:
        raise AssertionError(f"speculators loaded different weights for {differ}")
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(seed))
    n = len(tokens)
    feats = [torch.randn(n, 32) for _ in aux]
    captured: list[torch.Tensor] = []
    theirs.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out[0].detach()))
    with torch.no_grad():
        ours = head.eval().chain_logits(tokens, feats, torch.arange(n - 1), depth)
        theirs(hidden_states=torch.cat([f[:n - 1] for f in feats], -1).unsqueeze(0),
               input_ids=tokens[1:].unsqueeze(0), document_ids=torch.zeros(1, n - 1, dtype=torch.long),
               ttt_steps=depth)
    # depth j's rows whose teacher-forced tokens all exist (speculators pads the rest with token 0)
    return [float((a[:n - 1 - j] - b[:n - 1 - j]).abs().max()) for j, (a, b) in enumerate(zip(ours, captured))]


def main() -> None:
    parser = argparse.ArgumentParser(description="our EAGLE-3 draft logits vs speculators' Eagle3DraftModel")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--variant", choices=list(VARIANTS), help="one variant, in this process")
    args = parser.parse_args()
    if args.variant:  # one speculators model per process: a second one in the same process came out different
        sys.meta_path.append(_StubFinder())
        torch.set_num_threads(1)
        print(json.dumps(compare(VARIANTS[args.variant])))
        return
    results = {}
    for name in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", name], capture_output=True, text=True, check=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(results))
        return
    print(f"speculators {metadata.version('speculators')}: max |our draft logits - theirs| per depth")
    for name, diffs in results.items():
        print(f"  {name:24s} " + "  ".join(f"d{j}={d:.1e}" for j, d in enumerate(diffs)))


if __name__ == "__main__":
    main()
