"""A process that needs no torch imports none, even where it is installed: `calibrate run --plan`.

transformers imports torch wherever it is installed (5.x: the tokenizer and config modules import
configuration_utils, which imports modeling_rope_utils, which imports torch), so loading a target's tokenizer
costs torch's import though nothing of torch is used. transformers has a supported mode without torch
("only tokenizers, configuration and file/data utilities"), chosen when it finds no torch: this module has
the process find none. AutoTokenizer picks the same class and the same files in that mode (its choice reads
the checkpoint's files and never asks for torch; tests/test_plan.py compares the plan printed both ways).
"""

from __future__ import annotations

import os
import sys


def hide_torch() -> bool:
    """From now on this process imports no torch: `import torch` fails, and transformers and datasets, asking
    whether it is installed, are told no. Only for a command that needs nothing of torch and ends when its
    output is printed. Refused (False) once torch or transformers is imported: transformers decides at its
    own import, and a process that holds torch already gains nothing."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # Python's own "not importable" mark: importlib.util.find_spec answers None
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" line: we chose it
    return True
