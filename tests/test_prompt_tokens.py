"""Issue 37, group 4: a prompt is tokenized in memory bounded by its budget (calibrate.data.prompt_tokens).

The chunked tail and count must equal the whole text's tokenization exactly: checked here with chunks small
enough to cut each text dozens of times, on texts made to break a careless cut (long runs of one character,
added tokens, digits, multi-byte characters), for a byte-level BPE (GPT-2's pre-tokenizer, as Qwen, Llama 3,
DeepSeek), a BPE with no pre-tokenizer, and a SentencePiece-style one that cannot be cut at all; and on the
real trajectories' prompts with Qwen2.5's tokenizer (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from calibrate.data import prompt_tokens
from calibrate.data.prompt_tokens import count_tokens, splits, tail_tokens, token_ids
from tests.configs import QUICKSTART
from tests.tiny_pair import SPECIAL, build_tokenizer

KEEPS = (1, 7, 300, 5000, 10**9)


@pytest.fixture(scope="module")
def byte_level():
    return build_tokenizer()


def _bpe(normalizer=None, pre_tokenizer=None):
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIAL], show_progress=False)
    tok.train_from_iterator([_quickstart_text()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _quickstart_text() -> str:
    return "".join(f"<|user|>{json.dumps(json.loads(line))}<|end|>\n" for line in QUICKSTART.read_text().splitlines())


def adversarial_text() -> str:
    """The quickstart text with what a careless cut gets wrong spliced in: runs of one character far longer
    than a window, added tokens back to back, digit runs, emoji and CJK (multi-byte), CRLF, tabs."""
    base = _quickstart_text()
    spliced = ["=" * 5000, " " * 3000, "\n" * 700, "<|end|><|user|>" * 40, "1234567890" * 300, "😀🚀é" * 400,
               "机器学习模型" * 300, "\r\n\t" * 200, "ab" * 2000, "-=" * 1500]
    parts = []
    for i, extra in enumerate(spliced):
        parts += [base[i * 3000:(i + 1) * 3000], extra]
    return "".join(parts) + base


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt_tokens, "CHUNK_CHARS", 2048)
    monkeypatch.setattr(prompt_tokens, "SPLIT_REACH", 64)


def assert_same_as_whole(tokenizer, text: str) -> None:
    whole = token_ids(tokenizer, text)
    for keep in KEEPS:
        tail, total = tail_tokens(tokenizer, text, keep)
        assert total == len(whole), keep
        assert tail == whole[-keep:], keep


@pytest.mark.usefixtures("small_chunks")
def test_byte_level_chunks_add_up_to_the_whole(byte_level) -> None:
    assert splits(byte_level)
    assert_same_as_whole(byte_level, adversarial_text())


@pytest.mark.usefixtures("small_chunks")
def test_a_tokenizer_without_pre_tokenizer_chunks_exactly_too() -> None:
    tok = _bpe()
    assert_same_as_whole(tok, adversarial_text())


@pytest.mark.usefixtures("small_chunks")
def test_a_tokenizer_that_prepends_to_every_text_is_tokenized_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """SentencePiece's "▁" prepended to every text (Llama 2's normalizer) changes the first token of each chunk:
    such a tokenizer has no split point, and tokenizes whole texts, as before."""
    from tokenizers import normalizers

    tok = _bpe(normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]))
    assert not splits(tok)
    calls = []
    monkeypatch.setattr(prompt_tokens, "chunk_start", lambda *args: calls.append(args) or 0)
    assert_same_as_whole(tok, adversarial_text())
    assert not calls  # never cut


@pytest.mark.usefixtures("small_chunks")
def test_chunks_are_cut_where_the_text_allows_it(byte_level) -> None:
    """The chunks stay near CHUNK_CHARS (longer only by a run no window can split), and none is cut inside a
    run of one character."""
    text = adversarial_text()
    ends = [len(text)]
    while ends[-1] > 0:
        ends.append(prompt_tokens.chunk_start(byte_level, text, ends[-1]))
    assert len(ends) > len(text) // 2048
    assert max(a - b for a, b in zip(ends, ends[1:])) <= 2048 + 5000  # the longest run, "=" * 5000
    assert all(text[p - 1] != text[p] for p in ends[1:-1])


def test_short_texts_and_counts(byte_level) -> None:
    text = _quickstart_text()
    assert count_tokens(byte_level, text) == len(token_ids(byte_level, text))
    assert tail_tokens(byte_level, "", 4) == ([], 0)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        tail_tokens(byte_level, text, 0)


RSS_SCRIPT = """
import sys
from pathlib import Path
from transformers import AutoTokenizer
from calibrate.data.prompt_tokens import tail_tokens
tok = AutoTokenizer.from_pretrained(sys.argv[1])
text = Path(sys.argv[2]).read_text()
def kib(field):  # VmRSS: resident now; VmHWM: its peak in this program (ru_maxrss counts the parent's from before exec)
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])
before = kib("VmRSS:")
tail, total = tail_tokens(tok, text, 256)
print(len(tail), total, (kib("VmHWM:") - before) // 1024)
"""


def test_memory_is_bounded_by_the_budget(tmp_path: Path, byte_level) -> None:
    """A 3 MB prompt kept to 256 tokens: the tokenizer's peak memory is a chunk's (about 50 MB), where the whole
    text tokenized at once takes about 200 bytes a character with this small vocabulary (610 MB)."""
    byte_level.save_pretrained(tmp_path / "tok")
    text = (_quickstart_text() * 300)[: 3 * 2**20]
    (tmp_path / "prompt.txt").write_text(text)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "tok"), str(tmp_path / "prompt.txt")],
                         capture_output=True, text=True, timeout=300, check=True)
    kept, total, grown_mb = map(int, out.stdout.split())
    assert kept == 256 and total > 10**6
    assert grown_mb < 150, f"peak memory grew {grown_mb} MB tokenizing a 3 MB prompt"


@pytest.mark.slow
def test_the_real_trajectories_tail_equals_the_whole_tokenization(mini_swe_dir: Path, monkeypatch) -> None:
    """Every one of the 167 real trajectories' last prompt, rendered with Qwen2.5's template and cut into 4,096-
    character chunks: the kept tokens at budgets 1 ... 10^9 and the count equal the whole tokenization's."""
    from transformers import AutoTokenizer

    from calibrate.data import conversation_requests, load_conversations
    from calibrate.data.render import apply_template
    from tests.conftest import real_model

    tokenizer = AutoTokenizer.from_pretrained(real_model("qwen2.5-coder-1.5b-instruct"))
    monkeypatch.setattr(prompt_tokens, "CHUNK_CHARS", 4096)
    monkeypatch.setattr(prompt_tokens, "SPLIT_REACH", 128)
    conversations = load_conversations(str(mini_swe_dir)).conversations
    assert len(conversations) == 167
    budgets = (1, 100, 8192, 32768, 10**9)
    for i, conv in enumerate(conversations):
        request = conversation_requests(conv)[-1]
        text = apply_template(tokenizer, [m.to_template() for m in request.messages], model_name="qwen", what="x")
        whole = token_ids(tokenizer, text)
        keep = budgets[i % len(budgets)]
        assert tail_tokens(tokenizer, text, keep) == (whole[-keep:], len(whole)), conv.id


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"])
def test_real_tokenizers_cut_adversarial_text_exactly(model: str, small_chunks) -> None:
    """Qwen2.5 (a regex pre-tokenizer, byte-level), SmolLM2 (GPT-2's byte-level) and Gemma 3 (SentencePiece's
    "▁" for spaces, so no pre-tokenizer pieces: BPE over the whole text), each cut into 2,048-character chunks
    of the adversarial text."""
    from transformers import AutoTokenizer

    from tests.conftest import real_model

    tokenizer = AutoTokenizer.from_pretrained(real_model(model))
    assert splits(tokenizer)
    assert_same_as_whole(tokenizer, adversarial_text())
