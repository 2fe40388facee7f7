"""The sweep a `calibrate run` measures: a TOML file plus CLI overrides, validated before any model loads.

    [dataset]   where the conversations come from and how requests are picked and sized
    [run]       numerics and how counts are made (dtype, device, batch size, method)
    [[pairs]]   a target and the speculators to measure against it
    [sweep]     draft lengths, thinking modes, sampling

An unknown key or a bad value is an error naming the file, the table and the key: a typo in a sweep that
runs for hours must fail in the first second.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from calibrate.data.loader import SourceSpec
from calibrate.kernels import triton_unavailable
from calibrate.limits import INT32_MAX, MAX_BATCH, MAX_SAMPLES, MAX_SEED, MAX_TIMEOUT_SECONDS, MAX_TOKENS
from calibrate.terms import MAX_K, check_k
from calibrate.speculators.configs import CONFIG_TABLE, ModelName
from calibrate.speculators.registry import KINDS, SpeculatorConfigUnion, vllm_written_keys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


# A bound a validator enforces (a list's items, a rule across values) where pydantic's constraint metadata cannot
# say it: `checked(...)` puts it on the field, and the configuration reference shows it in its bounds column.
CHECKED = "checked"


def checked(bound: str) -> dict[str, str]:
    """Field(json_schema_extra=checked("each 1..64")): the bound the field's validator enforces, as a reader
    writes it; the validator stays what enforces it."""
    return {CHECKED: bound}


class _Strict(BaseModel):
    model_config = CONFIG_TABLE  # unknown keys, NaN / infinity and coerced types refused (speculators.base)


class DatasetConfig(_Strict):
    """Where the conversations come from, which assistant turns are replayed, and how each is sized."""

    source: str
    """A .json / .jsonl / .parquet file, a folder of them, a Hugging Face dataset id (streamed), or a name from
    calibrate/data/datasets.toml. A relative path that exists beside the config file is taken from there."""
    name: str | None = None
    """The dataset's label in tables and exports; defaults to `source` as written in the file, so tables carry
    no machine-specific path."""
    format: str | None = None
    """The rows' format (calibrate.data.formats.FORMATS, or an alias such as `swe-gym`); detected per file when
    unset. A format named for data it cannot fully read is refused, naming the field it would drop."""
    split: str | None = None
    """A hub dataset's split (`train`, `test`, ...)."""
    revision: str | None = None
    """A hub dataset's revision (a branch, tag or commit)."""
    subset: str | None = None
    """A hub dataset's subset (its config name, e.g. SPEED-Bench's `qualitative`)."""
    max_requests: int | None = Field(default=None, gt=0)
    """Assistant turns to replay, picked by `selection` from `seed`; unset: every turn the selection reaches."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seeds the selection, and at temperature > 0 the sampled responses' random streams (part of a sampled
    run's identity). 0..2^32 - 1: what every engine's seed takes (calibrate.limits)."""
    selection: Literal["stratified", "uniform", "first", "all"] = "stratified"
    """How turns are picked: `stratified` (round robin over conversations in seeded order, each one's turns in
    seeded order), `first` (the same, each conversation's first turns first), `uniform` (a seeded random
    sample of all turns), `all` (every turn). Not part of a run's identity (calibrate.data.turns)."""
    turns_per_conversation: int | None = Field(default=None, gt=0)
    """At most this many turns of each conversation, in the selection's order; unset: no cap."""
    conversations: int | None = Field(default=None, gt=0)
    """Whole trajectories: every turn of this many conversations (chosen in the order `selection` reaches
    them), measured in order within each conversation, conversations side by side (calibrate.data.turns).
    Does not combine with `max_requests`, `turns_per_conversation` or `selection = "all"`."""
    category: str | None = None
    """Only rows whose `category` field is this (SPEED-Bench, Spec-Bench: "coding", "math", ...); the rows of
    other categories are counted in the run's selection provenance."""
    context_tokens: int = Field(default=8192, gt=0, le=MAX_TOKENS)
    """Prompt budget: each prompt is left-truncated to its last `context_tokens` tokens (recorded per request).
    1..2^24 (calibrate.limits.MAX_TOKENS): past every model's context, inside the store's INTEGER columns."""
    max_new_tokens: int = Field(default=256, gt=0, le=MAX_TOKENS)
    """Tokens generated per response; a step this budget cuts while its drafts still matched is censored.
    1..2^24 (calibrate.limits.MAX_TOKENS)."""

    def source_spec(self) -> SourceSpec:
        """Where the run reads its conversations: the source settings of this table, as one record."""
        return SourceSpec(self.source, self.format, split=self.split, revision=self.revision, subset=self.subset,
                          category=self.category)

    @model_validator(mode="after")
    def _all_means_all(self) -> DatasetConfig:
        if self.conversations is not None:
            picking = [key for key in ("max_requests", "turns_per_conversation") if getattr(self, key) is not None]
            picking += ['selection = "all"'] if self.selection == "all" else []
            if picking:
                raise ValueError(f"conversations = {self.conversations} measures every turn of whole conversations; "
                                 f"{' and '.join(picking)} pick turns: drop one of them")
        if self.selection == "all" and self.max_requests is not None:
            raise ValueError(f"max_requests ({self.max_requests}) cannot apply with selection = \"all\", which "
                             "replays every turn: drop one of them")
        return self


DEVICE_PATTERN = r"^(auto|cpu|mps|cuda(:[0-9]+)?)$"


class RunConfig(_Strict):
    """Numerics and the method, shared by every pair of the sweep."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype in this process. `auto`: bf16 only where the device computes it natively (Ampere or later,
    a CPU with AVX-512 BF16, AMX or Arm BF16), fp32 elsewhere; the choice and its reason are stored with the
    run (`runs.dtype`, part of its identity, and `runs.dtype_reason`)."""
    device: str = Field(default="auto", pattern=DEVICE_PATTERN)
    """`auto`, `cpu`, `mps`, `cuda` or `cuda:N`; availability is checked before any model loads."""
    batch_size: int = Field(default=4, gt=0, le=MAX_BATCH)
    """Requests decoded together in this process. 1..4096 (calibrate.limits.MAX_BATCH)."""
    method: Literal["auto", "replay", "loop"] = "auto"
    """How the counts are made (was `engine`, refused naming this key). `replay` scores every speculator and k
    from one response per request (greedy, or at T > 0 sampled, under the target-only rule), generated in this
    process or, on a server pair, by a plain engine; `loop` decodes each (speculator, k) step by step: in this
    process, or on a server pair the engine's own speculation, a launch per (speculator, k). `auto` picks
    replay wherever it is exact (T = 0, or the target-only rule) and the loop for the probabilistic rule, the
    MoE profile, engine-only kinds and a connected server that speculates (the routing rules:
    calibrate.plan)."""
    verify_kernel: Literal["auto", "triton", "reference"] = "auto"
    """The loop's verification kernel: `auto` picks the fused Triton kernel wherever it runs (CUDA, triton
    importable) and the torch reference elsewhere (calibrate.kernels.resolve_kernel); `triton` where it
    cannot run is refused when the config is read."""
    verification: Literal["target-only", "probabilistic"] = "target-only"
    """Verification rule at temperature > 0 (calibrate.replay.loop.VERIFICATION_RULES): `target-only` drafts
    greedily and accepts with p_target(draft) (vLLM v1's model runner, SGLang's EAGLE, llama.cpp: the engines
    the exports feed); `probabilistic` samples drafts from q and accepts with min(1, p/q) (transformers'
    assisted generation), and needs the loop. Part of the run's identity."""
    experts: bool = False
    """The MoE verify-cost profile (calibrate.replay.experts): distinct routed experts per layer touched by each
    verify pass, per request and for batches of each size in `expert_batch_sizes`. It needs the step-by-step
    loop, so it picks method `loop` at T = 0 too; a dense target is refused from its config."""
    expert_batch_sizes: list[int] = Field(default_factory=lambda: [1], min_length=1,
                                          json_schema_extra=checked("each 1..`batch_size`"))
    """With `experts = true`: the batch sizes B whose union of experts is profiled (B requests of one engine
    batch decoded together), each 1..`batch_size`. Set without `experts`, it is refused."""
    prefix_reuse: bool = True
    """Whole trajectories (`[dataset] conversations`): a turn reuses the KV cache of its conversation's previous
    prompt (in-process), or the engine's prefix cache is on and each conversation's turns go in order
    (servers). false turns that off, for checks: it changes no count, so it is not part of a run's identity."""

    @model_validator(mode="after")
    def _expert_batches(self) -> RunConfig:
        if not self.experts and "expert_batch_sizes" in self.model_fields_set:
            raise ValueError("expert_batch_sizes is read only with experts = true (the MoE verify-cost profile)")
        if self.experts and self.method == "replay":
            raise ValueError("experts = true needs the step-by-step loop: set method = \"loop\" or \"auto\"")
        too_big = [b for b in self.expert_batch_sizes if not 1 <= b <= self.batch_size]
        if too_big:
            raise ValueError(f"expert_batch_sizes {too_big} outside 1..batch_size ({self.batch_size}): a batch of B "
                             "requests is formed within one engine batch")
        return self

    @model_validator(mode="after")
    def _triton_runs_here(self) -> RunConfig:
        reason = triton_unavailable(self.device) if self.verify_kernel == "triton" else None
        if reason:
            raise ValueError(f"verify_kernel = \"triton\" cannot run here: {reason}; use \"auto\" (Triton where it "
                             "runs, the torch reference elsewhere) or \"reference\"")
        return self


class ServerConfig(_Strict):
    """How a server backend is reached: `launch` starts the engine (plain, for replay; or speculating, one
    launch per (speculator, k)); `connect` uses a URL.

    `model` is what the engine loads (a GGUF file for llama.cpp, a path or hub id for vLLM / SGLang); the
    pair's `target` still names the tokenizer and chat template the prompts are rendered with.
    """

    mode: Literal["launch", "connect"] = "launch"
    """`launch`: calibrate starts the engine (and stops its whole process group on every exit); `connect`: a
    server you run, reached at `url`."""
    url: str | None = None
    """connect: the server's http:// or https:// URL with a host (no user:password@)."""
    k: int | None = Field(default=None, json_schema_extra=checked(f"1..{MAX_K}"))
    """connect: the k a speculating server was started with; unset: a plain server, measured by replay."""
    model: ModelName | None = None
    """launch: what the engine loads (a GGUF file for llama.cpp, a folder or hub id for vLLM / SGLang)."""
    command: str | None = None
    """launch: the engine executable; default per backend (the `[llamacpp]` extra's llama-server, the
    `make vllm` install, `python -m sglang.launch_server`)."""
    args: list[str] = Field(default_factory=list)
    """launch: extra engine arguments, passed as written (`["--enforce-eager", "--dtype", "bfloat16"]`)."""
    speculative_config: dict[str, Any] = Field(default_factory=dict)
    """launch, vLLM: keys added to the `--speculative-config` calibrate writes from the speculator and k
    (vllm/config/speculative.py names), for how the drafter runs, never what it proposes: the speculator's own
    keys are refused. vLLM picks the drafter's attention backend itself, not from `--attention-backend`, so an
    fp32 MLA model on a CPU with AMX needs `{attention_backend = "CPU_MLA"}` here too (AMX_MLA takes bf16 only)."""
    host: str = "127.0.0.1"
    """launch: the address the engine listens on."""
    port: int | None = Field(default=None, gt=0, lt=65536)
    """launch: the engine's port; unset picks a free one."""
    concurrency: int = Field(default=1, gt=0, le=MAX_BATCH)
    """Requests in flight where the engine counts per request, as in production; vLLM's counter deltas need 1.
    1..4096 (calibrate.limits.MAX_BATCH)."""
    startup_timeout: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT_SECONDS)
    """launch: seconds a launched engine has to answer, at most a week."""
    request_timeout: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT_SECONDS)
    """Seconds one request may take, at most a week."""
    log_dir: str | None = None
    """launch: a writable folder for the engine's log (checked when the config is read); default: the temp
    folder."""
    env: dict[str, str] = Field(default_factory=dict)
    """launch: environment variables for the engine, e.g. VLLM_CPU_KVCACHE_SPACE (GiB of KV cache for vLLM on
    CPU) or an SGLANG_* switch."""
    hidden_states: Literal["in-process", "engine"] = "in-process"
    """Plain-engine replay of EAGLE-3 / MTP: where the target's hidden states over prompt + response come from,
    a teacher-forced pass of `model` loaded in this process, or the engine's own (vLLM's
    extract_hidden_states: a second server, launched beside the plain one, or connected at
    `hidden_states_url`). calibrate.engines.hidden_states."""
    hidden_states_url: str | None = None
    """connect, with `hidden_states = "engine"`: a vLLM started with the extract_hidden_states method."""
    served_model: str | None = Field(default=None, min_length=1)
    """connect: the model the server serves where it is not `target` (a GGUF of it, another checkpoint): what
    the server must say it serves, and a condition of the run's rows (calibrate.engines.served_model)."""
    audit: bool = True
    """The engine audit at T > 0 (calibrate.engines.audit): each speculating server's per-step counts checked
    against its own tokens, with the speculator's in-process twin (loading it, and the target where it reads
    hidden states). false: not checked (rows then say nothing of it)."""

    @field_validator("k")
    @classmethod
    def _k_in_range(cls, value: int | None) -> int | None:
        if value is not None:
            check_k([value])
        return value

    @field_validator("log_dir")
    @classmethod
    def _writable_folder(cls, value: str | None) -> str | None:
        if value is None:
            return None
        folder = Path(value).expanduser()
        if not folder.is_dir():
            raise ValueError(f"log folder {value!r} " + ("is not a folder" if folder.exists() else "does not exist"))
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"log folder {value!r} is not writable")
        return str(folder)

    @model_validator(mode="after")
    def _mode(self) -> ServerConfig:
        if self.mode == "connect" and not self.url:
            raise ValueError("mode 'connect' needs `url` (and `k` where the server speculates)")
        if self.mode == "launch" and not self.model:
            raise ValueError("mode 'launch' needs `model` (the weights the engine loads)")
        wrong = [key for key in (LAUNCH_KEYS if self.mode == "connect" else CONNECT_KEYS) if key in self.model_fields_set]
        if wrong:
            what = ("a connected server runs what it was started with" if self.mode == "connect" else
                    "a launched server serves server.model and runs every sweep.k, one launch each, or none for "
                    "replay")
            raise ValueError(f"{', '.join(f'server.{key}' for key in wrong)}: not read in mode {self.mode!r} ({what})")
        return self


# The keys only one mode reads: set in the other, they would be ignored, so they are refused.
LAUNCH_KEYS = ("model", "command", "args", "speculative_config", "host", "port", "startup_timeout", "log_dir", "env")
CONNECT_KEYS = ("url", "k", "hidden_states_url", "served_model")



def has_credentials(url: str) -> bool:
    """Whether a URL carries user info (user:password@host): never accepted, so never printed or stored."""
    return "@" in urlsplit(url).netloc


_USER_INFO = re.compile(r"(?<=://)[^/?#@\s'\"]*@")


def redact_credentials(text: str) -> str:
    """`text` with the user info of every URL in it replaced by `***@` (an error message shows the values it
    refused, and a password must not reach a terminal or a log)."""
    return _USER_INFO.sub("***@", text)


def is_server_url(url: str) -> bool:
    """http:// or https:// with a host (and a port that is a number, if any): what the server backends reach."""
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


class PairConfig(_Strict):
    """A target and the speculators measured against it (`[[pairs]]`, one table per target)."""

    target: str
    """The target model: a hub id, a local folder, or a .gguf file. It always names the tokenizer and chat
    template the prompts are rendered with, also where a server loads `server.model`."""
    speculators: list[SpeculatorConfigUnion] = Field(min_length=1)
    """The speculators, one inline table each, chosen by `kind` (the kinds below); two with the same settings
    are refused."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra arguments for the target's chat template (its thinking switch, where it is not detected)."""
    chat_template: bool = True
    """Render prompts with the target's chat template (the default), or `false`: as a benchmark that skips the
    template sends them (InferenceX's DeepSeek-V4 recipes, `use_chat_template: false`), the messages' text
    joined, no role markers, tokenized with the tokenizer's own special tokens (calibrate.data.raw_prompt).
    It changes the prompt tokens, so `false` is part of the run's identity (`runs.chat_template = 'off'`);
    without a template there is no thinking switch, so only `sweep.thinking = ["off"]` is measured."""
    backend: Literal["transformers", "llama.cpp", "vllm", "sglang"] = "transformers"
    """Where the target runs: `transformers` in this process, or a serving engine (needs `[pairs.server]`)."""
    server: ServerConfig | None = None
    """`[pairs.server]`: how a server backend is launched or reached (below)."""

    @model_validator(mode="after")
    def _template_kwargs_need_template(self) -> PairConfig:
        if not self.chat_template and self.chat_template_kwargs:
            raise ValueError("chat_template_kwargs are read by the chat template, and chat_template = false renders "
                             "without one: drop one of them")
        return self

    @model_validator(mode="after")
    def _backend(self) -> PairConfig:
        if self.backend == "transformers" and self.server is not None:
            raise ValueError("[pairs.server] is for server backends; set backend = \"llama.cpp\", \"vllm\" or "
                             "\"sglang\"")
        if self.backend != "transformers" and self.server is None:
            raise ValueError(f"backend {self.backend!r} needs a [pairs.server] table (mode, url or model)")
        if self.server is not None and self.server.speculative_config:
            self._speculative_config_adds_only(set(self.server.speculative_config))
        for i, spec in enumerate(self.speculators):
            if self.backend == "transformers" and not KINDS[spec.kind].in_process:
                raise ValueError(f"speculators[{i}] ({spec.kind}, method {getattr(spec, 'method', '?')!r}) runs only "
                                 "inside a serving engine: set backend = \"vllm\" or \"sglang\" with a "
                                 "[pairs.server] table")
        return self

    def _speculative_config_adds_only(self, extra: set[str]) -> None:
        """server.speculative_config is vLLM's, and adds keys: the ones calibrate writes for a speculator (its
        method, k, its settings) would change what is measured under the speculator's name."""
        if self.backend != "vllm":
            raise ValueError(f"server.speculative_config is vLLM's --speculative-config; backend {self.backend!r} "
                             "takes its speculative settings as flags: put them in server.args")
        for i, spec in enumerate(self.speculators):
            try:
                method = KINDS[spec.kind].backend_method(spec, "vllm", lambda name: name)
            except ValueError:
                continue  # refused where the run is planned, with its reason
            written = vllm_written_keys(method)
            if extra & written:
                raise ValueError(f"server.speculative_config sets {', '.join(sorted(extra & written))}, which "
                                 f"calibrate writes for speculators[{i}] ({spec.kind}): set it on the speculator")

    @field_validator("server")
    @classmethod
    def _url(cls, server: ServerConfig | None, info: ValidationInfo) -> ServerConfig | None:
        for key in ("url", "hidden_states_url"):
            url = getattr(server, key, None)
            if url is not None and has_credentials(url):
                raise ValueError(f"{key} holds credentials (user:password@): calibrate sends none, and a URL is "
                                 "printed in messages and stored with each run; give the URL without them")
            if url is not None and not is_server_url(url):
                raise ValueError(f"{key} {url!r} is not a URL of a {info.data.get('backend', 'server')} server: "
                                 "give http:// or https:// and a host (http://head-node:8000)")
        return server

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
    """What is swept for every pair: draft lengths, thinking modes, sampling."""

    k: list[int] = Field(min_length=1, json_schema_extra=checked(f"each 1..{MAX_K}; repeats merged"))
    """The draft lengths, each 1..64 (calibrate.terms.MAX_K); a k of at least `max_new_tokens` is
    warned about."""
    thinking: list[Literal["on", "off"]] = Field(default_factory=lambda: ["off"], min_length=1)
    """Thinking modes, rendered with the target's own switch; a mode its template cannot honour is refused."""
    temperature: list[float] = Field(default_factory=lambda: [0.0], min_length=1,
                                     json_schema_extra=checked("each finite, >= 0"))
    """Sampling temperatures (a number or a list), each >= 0; 0 is greedy."""
    top_p: float | None = Field(default=None, gt=0, le=1)
    """Nucleus sampling at T > 0, in (0, 1]; unset: off."""
    top_k: int | None = Field(default=None, gt=0, le=INT32_MAX)
    """Top-k sampling at T > 0, 1..2^31 - 1 (the store's INTEGER column); unset: off."""
    samples: int = Field(default=1, gt=0, le=MAX_SAMPLES, strict=True)
    """Responses sampled per request at each T > 0 (each its own keyed random stream; stored as rows of their
    own, clustered with their conversation). Not part of a run's identity: more samples later measure only
    the new ones. 1..1000 (calibrate.limits.MAX_SAMPLES); above 1 every temperature must be > 0."""

    @field_validator("temperature", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, (int, float)) else value

    @field_validator("k")
    @classmethod
    def _in_range_unique(cls, value: list[int]) -> list[int]:
        check_k(value)
        return sorted(set(value))

    @field_validator("temperature")
    @classmethod
    def _non_negative(cls, value: list[float]) -> list[float]:
        if any(not math.isfinite(t) or t < 0 for t in value):
            raise ValueError("temperature must be a finite number >= 0")
        return value

    @model_validator(mode="after")
    def _samples_are_sampled(self) -> SweepConfig:
        if self.samples > 1 and 0 in self.temperature:
            raise ValueError(f"samples = {self.samples} needs every temperature > 0: at temperature 0 the response "
                             "is greedy, and every sample would be the same")
        return self


class Config(_Strict):
    """A whole sweep file."""

    dataset: DatasetConfig
    """`[dataset]`: the conversations and the requests cut from them."""
    run: RunConfig = Field(default_factory=RunConfig)
    """`[run]`: numerics and the engine choice."""
    pairs: list[PairConfig] = Field(min_length=1)
    """`[[pairs]]`: one table per target."""
    sweep: SweepConfig
    """`[sweep]`: draft lengths, thinking modes, sampling."""

    @model_validator(mode="after")
    def _thinking_needs_template(self) -> Config:
        raw = [n for n, p in enumerate(self.pairs) if not p.chat_template]
        if raw and "on" in self.sweep.thinking:
            raise ValueError(f"pairs{raw} set chat_template = false, which renders no thinking switch: sweep.thinking "
                             "\"on\" cannot be honoured there; measure thinking = [\"off\"], or the template")
        return self

    @model_validator(mode="after")
    def _experts_in_process(self) -> Config:
        served = [p.target for p in self.pairs if p.backend != "transformers"]
        if self.run.experts and served:
            raise ValueError(f"run.experts = true reads the router in process: pairs {served} use a server backend")
        return self

    def warnings(self) -> list[str]:
        """Settings that run but probably do not measure what was meant (printed before the run starts)."""
        out = []
        too_long = [k for k in self.sweep.k if k >= self.dataset.max_new_tokens]
        if too_long:
            out.append(f"sweep.k {too_long} >= dataset.max_new_tokens ({self.dataset.max_new_tokens}): "
                       "no step can check all k drafts before the budget ends, so those steps are censored")
        return out


TABLES = ("dataset", "run", "sweep")  # the single tables ([[pairs]] is a list of them)


class ConfigError(ValueError):
    """A config that cannot run, with every problem named (file, table, key)."""


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in KINDS and out.endswith("]"):
            continue  # pydantic's discriminator tag adds nothing for a reader
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


# Keys earlier versions read, and what they are called now (one word per concept: k, the verify kernel, the
# method that makes the counts); "table.key" where the old name is a word other tables may still use.
RENAMED = {"draft_lengths": "k", "draft_len": "k", "verify_backend": "verify_kernel", "run.engine": "method"}


def renamed(loc: tuple[Any, ...]) -> str | None:
    """What the key at `loc` is called now, or None where it never had another name."""
    if not loc:
        return None
    old = str(loc[-1])
    return (RENAMED.get(f"{loc[0]}.{old}") if len(loc) == 2 else None) or RENAMED.get(old)


def format_errors(path: str, exc: ValidationError) -> str:
    lines = [f"{path}: invalid config"]
    for err in exc.errors():
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            now = renamed(tuple(err["loc"]))
            msg = f"unknown key (now called `{now}`)" if now else "unknown key"
        elif err["type"] == "union_tag_invalid":
            msg = f"unknown speculator kind {err['input'].get('kind')!r} (known: {', '.join(KINDS)})" \
                if isinstance(err.get("input"), dict) else msg
        hidden = err["type"] in ("missing", "union_tag_invalid") or not err["loc"]  # top level: the whole file
        shown = "" if hidden else f" (got {err.get('input')!r})"
        lines.append(f"  {_where(err['loc'])}: {msg}{shown}")
    return redact_credentials("\n".join(lines))


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name the filesystem cannot hold (NUL, too long) is no file here
        return False


def load_config(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read and validate a config; `overrides` (e.g. {"dataset": {"max_requests": 4}}) win over the file.

    A relative dataset source that exists beside the config file is taken relative to it; the dataset's
    label (`name`) stays as written, so tables do not carry machine-specific paths.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file (TOML)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for table in TABLES:
        if table in raw and not isinstance(raw[table], dict):
            raise ConfigError(f"{path}: [{table}] must be a table (a [{table}] header with keys under it), got "
                              f"{table} = {raw[table]!r}")
    if "pairs" in raw and not (isinstance(raw["pairs"], list) and all(isinstance(p, dict) for p in raw["pairs"])):
        raise ConfigError(f"{path}: pairs must be [[pairs]] tables, got pairs = {raw['pairs']!r}")
    for table, values in (overrides or {}).items():
        raw.setdefault(table, {}).update({k: v for k, v in values.items() if v is not None})
    source = raw.get("dataset", {}).get("source")
    if isinstance(source, str):
        raw["dataset"].setdefault("name", source)  # a label that does not depend on where the repo lives
        if not Path(source).is_absolute() and _exists(path.parent / source):
            raw["dataset"]["source"] = str((path.parent / source).resolve())
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_errors(str(path), exc)) from None
