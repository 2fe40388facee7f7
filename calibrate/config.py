"""The sweep a `calibrate run` measures: a TOML file plus CLI overrides, validated before any model loads.

    [dataset]   where the conversations come from and how requests are picked and sized
    [run]       numerics and engine choice (dtype, device, batch size, engine)
    [[pairs]]   a target and the speculators to measure against it
    [sweep]     draft lengths, thinking modes, sampling

An unknown key or a bad value is an error naming the file, the table and the key: a typo in a sweep that
runs for hours must fail in the first second.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatasetConfig(_Strict):
    source: str
    name: str | None = None  # label in tables and exports; defaults to `source` as written in the file
    format: str | None = None
    split: str | None = None
    revision: str | None = None
    subset: str | None = None
    max_requests: int | None = Field(default=None, gt=0)
    seed: int = 0
    selection: Literal["stratified", "uniform", "first", "all"] = "stratified"
    turns_per_conversation: int | None = Field(default=None, gt=0)
    context_tokens: int = Field(default=8192, gt=0)
    max_new_tokens: int = Field(default=256, gt=0)


class RunConfig(_Strict):
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    device: str = "auto"
    batch_size: int = Field(default=4, gt=0)
    engine: Literal["auto", "replay", "loop"] = "auto"
    verify_backend: Literal["auto", "triton", "reference"] = "auto"


class DraftSpeculatorConfig(_Strict):
    kind: Literal["draft"]
    model: str
    gguf: str | None = None  # llama.cpp backend: the draft's GGUF file (`model` still names its tokenizer)


class NgramSpeculatorConfig(_Strict):
    kind: Literal["ngram"]
    max_n: int = Field(default=4, gt=0)
    min_n: int = Field(default=1, gt=0)

    @model_validator(mode="after")
    def _order(self) -> NgramSpeculatorConfig:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


class SuffixSpeculatorConfig(_Strict):
    """Suffix decoding; the keys are vLLM's `suffix_decoding_*` options, with their defaults."""

    kind: Literal["suffix"]
    max_depth: int = Field(default=24, gt=0)
    max_spec_factor: float = Field(default=1.0, ge=0)
    max_spec_offset: float = 0.0
    min_token_prob: float = Field(default=0.1, ge=0, le=1)


SpeculatorConfig = Annotated[Union[DraftSpeculatorConfig, NgramSpeculatorConfig, SuffixSpeculatorConfig],
                             Field(discriminator="kind")]


class ServerConfig(_Strict):
    """How a server backend is reached: `launch` starts the engine per (speculator, k); `connect` uses a URL.

    `model` is what the engine loads (a GGUF file for llama.cpp, a path or hub id for vLLM / SGLang); the
    pair's `target` still names the tokenizer and chat template the prompts are rendered with.
    """

    mode: Literal["launch", "connect"] = "launch"
    url: str | None = None  # connect
    draft_len: int | None = Field(default=None, gt=0)  # connect: the k the server was started with
    model: str | None = None  # launch
    command: str | None = None  # launch: the engine executable (default: per backend)
    args: list[str] = Field(default_factory=list)  # launch: extra engine arguments, passed as written
    host: str = "127.0.0.1"
    port: int | None = Field(default=None, gt=0, lt=65536)  # launch: None picks a free port
    concurrency: int = Field(default=1, gt=0)  # requests in flight where the engine counts per request
    startup_timeout: float = Field(default=600.0, gt=0)
    request_timeout: float = Field(default=600.0, gt=0)
    log_dir: str | None = None  # launch: where the engine's log goes (default: the temp folder)

    @model_validator(mode="after")
    def _mode(self) -> ServerConfig:
        if self.mode == "connect" and (not self.url or self.draft_len is None):
            raise ValueError("mode 'connect' needs `url` and `draft_len` (the k the server drafts)")
        if self.mode == "launch" and not self.model:
            raise ValueError("mode 'launch' needs `model` (the weights the engine loads)")
        return self



class PairConfig(_Strict):
    target: str
    speculators: list[SpeculatorConfig] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    backend: Literal["transformers", "llama.cpp", "vllm", "sglang"] = "transformers"
    server: ServerConfig | None = None

    @model_validator(mode="after")
    def _backend(self) -> PairConfig:
        if self.backend == "transformers" and self.server is not None:
            raise ValueError("[pairs.server] is for server backends; set backend = \"llama.cpp\", \"vllm\" or "
                             "\"sglang\"")
        if self.backend != "transformers" and self.server is None:
            raise ValueError(f"backend {self.backend!r} needs a [pairs.server] table (mode, url or model)")
        if self.server is not None and self.server.mode == "connect" and len(self.speculators) != 1:
            raise ValueError("a connected server runs one speculator: list exactly the one it was started with")
        return self

    @field_validator("speculators")
    @classmethod
    def _distinct(cls, value: list[Any]) -> list[Any]:
        seen: dict[str, int] = {}
        for i, spec in enumerate(value):
            key = repr(sorted(spec.model_dump().items()))
            if key in seen:
                raise ValueError(f"speculators[{i}] repeats speculators[{seen[key]}] ({spec.kind}, same settings)")
            seen[key] = i
        return value


class SweepConfig(_Strict):
    draft_lengths: list[int] = Field(min_length=1)
    thinking: list[Literal["on", "off"]] = Field(default_factory=lambda: ["off"], min_length=1)
    temperature: list[float] = Field(default_factory=lambda: [0.0], min_length=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, gt=0)

    @field_validator("temperature", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, (int, float)) else value

    @field_validator("draft_lengths")
    @classmethod
    def _positive_unique(cls, value: list[int]) -> list[int]:
        if any(k < 1 for k in value):
            raise ValueError("draft lengths must be >= 1")
        return sorted(set(value))

    @field_validator("temperature")
    @classmethod
    def _non_negative(cls, value: list[float]) -> list[float]:
        if any(t < 0 for t in value):
            raise ValueError("temperature must be >= 0")
        return value


class Config(_Strict):
    dataset: DatasetConfig
    run: RunConfig = Field(default_factory=RunConfig)
    pairs: list[PairConfig] = Field(min_length=1)
    sweep: SweepConfig


class ConfigError(ValueError):
    """A config that cannot run, with every problem named (file, table, key)."""


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("draft", "ngram", "suffix") and out.endswith("]"):
            continue  # pydantic's discriminator tag adds nothing for a reader
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_errors(path: str, exc: ValidationError) -> str:
    lines = [f"{path}: invalid config"]
    for err in exc.errors():
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "union_tag_invalid":
            msg = f"unknown speculator kind {err['input'].get('kind')!r} (known: draft, ngram, suffix)" \
                if isinstance(err.get("input"), dict) else msg
        shown = "" if err["type"] in ("missing", "union_tag_invalid") else f" (got {err.get('input')!r})"
        lines.append(f"  {_where(err['loc'])}: {msg}{shown}")
    return "\n".join(lines)


def load_config(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read and validate a config; `overrides` (e.g. {"dataset": {"max_requests": 4}}) win over the file.

    A relative dataset source that exists beside the config file is taken relative to it; the dataset's
    label (`name`) stays as written, so tables do not carry machine-specific paths.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for table, values in (overrides or {}).items():
        raw.setdefault(table, {}).update({k: v for k, v in values.items() if v is not None})
    source = raw.get("dataset", {}).get("source")
    if isinstance(source, str):
        raw["dataset"].setdefault("name", source)  # a label that does not depend on where the repo lives
        if not Path(source).is_absolute() and (path.parent / source).exists():
            raw["dataset"]["source"] = str((path.parent / source).resolve())
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_errors(str(path), exc)) from None
