"""The manual (docs/, built with MkDocs): the generated configuration reference is current, every key has a
description, and the pages build with no broken link or anchor."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from calibrate import config, config_reference

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_current() -> None:
    """docs/reference/configuration.md is what the config models generate: a key renamed, added or
    re-described without regenerating fails here."""
    checked_in = (ROOT / config_reference.PAGE).read_text(encoding="utf-8")
    assert config_reference.render() == checked_in, (
        f"{config_reference.PAGE} is out of date with calibrate/config.py: regenerate it with "
        f"`{config_reference.REGENERATE}` (from the repository root) and commit the result")


def test_every_key_is_in_the_reference() -> None:
    """Each table's keys and each speculator kind's keys appear as rows of the page."""
    page = config_reference.render()
    for header, model in config_reference.tables(config.Config):
        assert f"## `{header}`" in page
        for key in model.model_fields:
            assert f"| `{key}` |" in page, (header, key)
    for kind, cls in config_reference.KINDS.items():
        assert f'### `kind = "{kind}"`' in page
        for key in cls.config_model.model_fields:
            assert f"| `{key}` |" in page, (kind, key)


def test_a_key_without_a_description_fails_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tiny(BaseModel):
        model_config = {"use_attribute_docstrings": True}

        documented: int = 1
        """Has one."""
        bare: int = 2

    class Sweep(BaseModel):
        model_config = {"use_attribute_docstrings": True}

        sweep: Tiny
        """The table."""

    monkeypatch.setattr(config_reference.config, "Config", Sweep)
    with pytest.raises(config_reference.UndocumentedKeys, match=r"sweep\.bare \(") as caught:
        config_reference.render()
    assert "documented" not in str(caught.value)


def test_check_mode_names_the_command_that_regenerates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert config_reference.main(["--check", "--out", str(stale)]) == 1
    assert config_reference.REGENERATE in capsys.readouterr().err
    assert config_reference.main(["--out", str(stale)]) == 0
    assert config_reference.main(["--check", "--out", str(stale)]) == 0


def test_types_and_defaults_read_as_toml() -> None:
    fields = config.RunConfig.model_fields
    assert config_reference.type_name(fields["dtype"].annotation) == '"auto" \\| "float32" \\| "bfloat16" \\| "float16"'
    assert config_reference.type_name(fields["expert_batch_sizes"].annotation) == "list of integer"
    assert config_reference.default(fields["expert_batch_sizes"]) == "`[1]`"
    assert config_reference.default(config.DatasetConfig.model_fields["source"]) == "required"
    assert config_reference.default(config.DatasetConfig.model_fields["max_requests"]) == "unset"
    assert config_reference.bounds(config.RunConfig.model_fields["batch_size"]) == "> 0, <= 4,096"
