"""A tiny real-shaped target + draft pair on disk (random Llama weights, a BPE tokenizer trained on the
quickstart sample, a chat template with tools), and a sweep over them: `calibrate run` end to end in seconds."""

from __future__ import annotations

import json
from pathlib import Path

from tests.configs import QUICKSTART, write_config
from tests.conftest import tiny_llama

SPECIAL = ["<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>"]
TEMPLATE = (
    "{% if tools %}<|system|>tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments }}</tool_call>"
    "{% endfor %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _texts() -> list[str]:
    texts = []
    for line in QUICKSTART.read_text().splitlines():
        row = json.loads(line)
        texts.extend(json.dumps(m) for m in row["messages"])
    return texts


def build_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = TEMPLATE
    return fast


def build_pair(root: Path) -> tuple[Path, Path]:
    """target/ and draft/ under `root`: same tokenizer, different random weights (seeds 0 and 1)."""
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|end|>")
    out = []
    for name, seed, hidden in (("target", 0, 64), ("draft", 1, 32)):
        model = tiny_llama(vocab_size=len(tokenizer), seed=seed, hidden=hidden)
        model.config.eos_token_id = model.generation_config.eos_token_id = eos
        model.config.bos_token_id = model.generation_config.bos_token_id = None
        model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out.append(root / name)
    return out[0], out[1]


def sweep_config(root: Path, target: Path, draft: Path, requests: int = 4) -> Path:
    """tiny.toml under `root`: the pair on the quickstart sample, draft model, n-gram and suffix at k = 1..4."""
    return write_config(
        root / "tiny.toml",
        dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "max_requests": requests,
                 "context_tokens": 256, "max_new_tokens": 24},
        run={"device": "cpu", "batch_size": 2},
        pairs=[{"target": target,
                "speculators": [{"kind": "draft", "model": draft}, {"kind": "ngram"}, {"kind": "suffix"}]}],
        sweep={"k": [1, 2, 3, 4]},
    )
