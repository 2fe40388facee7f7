"""Model loading: names resolve predictably, GGUF files load, and a draft with another tokenizer is refused."""

from __future__ import annotations

import pytest
import torch

from calibrate.fingerprints import fingerprint
from calibrate.model_files import load_tokenizer
from calibrate.model_names import built_models_dir, resolve
from calibrate.model_files import check_same_tokenizer
from calibrate.models import load_model


def test_resolve_order(tmp_path, monkeypatch):
    monkeypatch.setenv("CALIBRATE_TEST_MODELS", str(tmp_path))
    (tmp_path / "my-model").mkdir()
    assert resolve("my-model") == str(tmp_path / "my-model")  # a built test model by name
    assert resolve(str(tmp_path)) == str(tmp_path.resolve())  # an existing path
    assert resolve("Org/Some-Model") == "Org/Some-Model"  # otherwise a hub id


def test_fingerprint_changes_with_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a" * 1000)
    before = fingerprint(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"a" * 999 + b"b")
    assert fingerprint(str(tmp_path)) != before


def test_unloadable_model_names_it(tmp_path):
    missing = str(tmp_path / "nowhere" / "at-all")
    with pytest.raises(FileNotFoundError, match="no such file or folder") as err:
        load_tokenizer(missing)  # a path that does not exist never goes to the hub
    assert f"model {missing!r}" in str(err.value)


def test_draft_with_another_tokenizer_is_refused(qwen_target, smollm):
    with pytest.raises(ValueError, match="different tokenizer") as err:
        check_same_tokenizer("qwen", load_tokenizer(str(qwen_target)), "smollm", load_tokenizer(str(smollm)))
    assert "'smollm'" in str(err.value) and "'qwen'" in str(err.value)
    # the Qwen 0.5B draft shares the 1.5B's tokenizer
    draft = built_models_dir() / "qwen2.5-coder-0.5b-instruct"
    if draft.exists():
        check_same_tokenizer("qwen", load_tokenizer(str(qwen_target)), "draft", load_tokenizer(str(draft)))


@pytest.mark.slow
@pytest.mark.integration
def test_gguf_file_loads_and_agrees_with_its_conversion(smollm):
    gguf = smollm / "smollm2-135m-instruct.gguf"  # kept beside its conversion (make models: --keep-gguf)
    if not gguf.exists():
        pytest.skip("no kept GGUF file (make models builds one)")
    from_gguf = load_model(str(gguf), "float32", "cpu")
    from_folder = load_model(str(smollm), "float32", "cpu")
    assert from_gguf.model_id == str(gguf) and len(from_gguf.fingerprint) == 16
    ids = from_folder.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    assert from_gguf.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.inference_mode():
        a = from_gguf.model(input_ids=ids).logits[0, -1]
        b = from_folder.model(input_ids=ids).logits[0, -1]
    # the folder holds the same weights rounded to bf16: same prediction, close logits
    assert int(a.argmax()) == int(b.argmax())
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.99
