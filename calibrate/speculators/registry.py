"""The one list of speculator kinds: the config's `kind` values, its validation and the runner's factory.

Adding a kind = one module with its Speculator subclass (which declares `kind`, `config_model`, `build` and
optionally `check`) plus one line here.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from calibrate.speculators.base import Speculator
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.speculators.eagle3 import Eagle3Speculator
from calibrate.speculators.engine_only import EngineOnlySpeculator
from calibrate.speculators.mtp import MtpSpeculator
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.speculators.suffix import SuffixSpeculator

KINDS: dict[str, type[Speculator]] = {
    cls.kind: cls for cls in (DraftModelSpeculator, NgramSpeculator, SuffixSpeculator, Eagle3Speculator,
                           MtpSpeculator, EngineOnlySpeculator)
}

# The `[[pairs]].speculators` entry: one of the kinds' config models, chosen by `kind`.
SpeculatorConfigUnion = Annotated[Union[tuple(cls.config_model for cls in KINDS.values())],  # noqa: UP007
                                  Field(discriminator="kind")]


def speculator_class(kind: str) -> type[Speculator]:
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown speculator kind {kind!r} (known: {', '.join(KINDS)})") from None
