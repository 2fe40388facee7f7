"""Third-party chatter off for the length of a command: what a user reads is ours.

Loading a model prints a "Loading weights" bar, GGUF files a de-quantisation bar per tensor, transformers
and the hub log dtype notes and download retries, and libraries raise warnings meant for their developers.
`--verbose` keeps all of it. Everything changed here is put back on exit, so a notebook or a test calling
the library afterwards sees its usual settings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

_LOGGERS = ("transformers", "huggingface_hub", "datasets", "accelerate", "torch")


@contextlib.contextmanager
def quiet_third_party(enabled: bool = True) -> Iterator[None]:
    """Silence third-party progress bars, log records below ERROR, warnings and stray stderr writes.

    Writes to `sys.stderr` go to os.devnull meanwhile (GGUF de-quantisation bars write there directly), so
    our own output must use a stream taken before entering: the CLI's rich console holds the real stderr.
    """
    if not enabled:
        yield
        return
    import datasets
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as tf_logging

    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    bars = (tf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled(),
            hub_utils.are_progress_bars_disabled())
    tf_verbosity = tf_logging.get_verbosity()
    with open(os.devnull, "w") as sink, warnings.catch_warnings(), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        for name in _LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        tf_logging.set_verbosity_error()
        tf_logging.disable_progress_bar()
        datasets.disable_progress_bars()
        hub_utils.disable_progress_bars()
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            tf_logging.set_verbosity(tf_verbosity)
            if bars[0]:
                tf_logging.enable_progress_bar()
            if bars[1]:
                datasets.enable_progress_bars()
            if not bars[2]:
                hub_utils.enable_progress_bars()

