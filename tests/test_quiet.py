"""Third-party chatter is hidden during a command unless --verbose, and every setting is put back after."""

from __future__ import annotations

import logging
import warnings

import pytest

from calibrate.quiet import quiet_third_party


def _chatter() -> None:
    from tqdm.auto import tqdm

    for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):  # what GGUF loading prints
        pass
    warnings.warn("a library's note to its developers", UserWarning, stacklevel=1)
    logging.getLogger("transformers.modeling_utils").warning("dtype note")


def test_quiet_hides_bars_warnings_and_logs(capsys: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as tf_logging

    verbosity, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    level = logging.getLogger("huggingface_hub").level
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_third_party():
            _chatter()
    assert capsys.readouterr().err == ""
    assert not caught
    assert tf_logging.get_verbosity() == verbosity and tf_logging.is_progress_bar_enabled() == bars
    assert logging.getLogger("huggingface_hub").level == level


def test_verbose_keeps_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(UserWarning, match="note to its developers"):
        with quiet_third_party(enabled=False):
            _chatter()
    assert "de-quantizing GGUF tensors" in capsys.readouterr().err
