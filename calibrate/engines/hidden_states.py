"""The target's hidden states over prompt + response, which EAGLE-3 and MTP chain-draft from when replay
scores a server's responses: from a teacher-forced pass of the target in this process, or from the engine.

From the engine: vLLM's `extract_hidden_states` speculative method (vllm/config/speculative.py) caches the
inputs of the layers `eagle_aux_hidden_state_layer_ids` (what vLLM's EAGLE-3 reads, and what transformers
calls `hidden_states[i]`), and a hidden-states connector writes each finished request's rows to a
safetensors file whose path comes back in the reply's `kv_transfer_params.hidden_states_path`. One request
per response, prompt + response as its prompt and one new token, gives every position's rows. vLLM's own
connector copies through CUDA streams and pinned memory; the one launched here
(calibrate/engines/vllm_side/calibrate_hidden_states.py) copies plainly, so the path runs on vLLM's CPU
build too. Files are read under the connector's lock, checked (the tokens sent, the target's width) and
removed. The final hidden state (after the model's norm) is not among the captured rows, so MTP, which
drafts from it, needs the in-process pass.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from calibrate.engines.base import Budget
from calibrate.engines.inflight import concurrently
from calibrate.engines.server import EngineError, Server, http_json
from calibrate.models import LoadedModel
from calibrate.replay.responses import target_features
from calibrate.speculators.base import TargetFeatures, TargetNeeds

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
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}}
    transfer = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(transfer)]


def connector_env(env: dict[str, str]) -> dict[str, str]:
    """The launched vLLM's environment with the connector's folder first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(CONNECTOR_DIR), env.get("PYTHONPATH", os.environ.get("PYTHONPATH")))
                           if p)
    return {**env, "PYTHONPATH": path}


class EngineFeatures(contextlib.AbstractContextManager):
    """vLLM's hidden-state pass, served by its own server (launched beside the plain one, or connected): a
    context manager, the server's lifetime."""

    name = "vllm"
    dtype = "as served"

    def __init__(self, backend: Any, cfg: Any, budget: Budget, layers: Sequence[int], hidden_size: int):
        self.backend, self.cfg, self.layers, self.hidden_size = backend, cfg, tuple(layers), hidden_size
        self.folder = Path(tempfile.mkdtemp(prefix="calibrate-hidden-states-"))
        launch = cfg.mode == "launch"
        command = ((lambda host, port: backend.plain_command(cfg, host, port, budget,
                                                             *hidden_state_flags(self.layers, self.folder)))
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

    def features(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 needs: TargetNeeds) -> list[TargetFeatures]:
        if needs.last:
            raise EngineError(f"{self.server.engine} at {self.server.url}: the target's final hidden state (MTP "
                              "drafts from it) is not among what extract_hidden_states captures")
        missing = sorted(set(needs.layers) - set(self.layers))
        if missing:
            raise EngineError(f"{self.server.engine} at {self.server.url}: serves layers {list(self.layers)}, "
                              f"not {missing}")
        jobs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
        rows = concurrently(self._rows, jobs, self.cfg.concurrency, self.server.inflight)
        return [TargetFeatures({layer: h[:, self.layers.index(layer)] for layer in needs.layers}) for h in rows]

    def _rows(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), layers, hidden) float32: the captured rows of one sequence."""
        body = {"model": self.server.info["model"], "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True, "stream": False}
        where = f"{self.server.engine} at {self.server.url}"
        try:
            resp = http_json(self.server.engine, self.server.url + "/v1/completions", body,
                             timeout=self.cfg.request_timeout, inflight=self.server.inflight)
            path = resp["kv_transfer_params"]["hidden_states_path"]
        except EngineError as exc:
            raise self.server.explain(exc) from None
        except (KeyError, TypeError):
            raise EngineError(f"{where}: the reply names no kv_transfer_params.hidden_states_path: is it started "
                              "with the extract_hidden_states method and a hidden-states connector?") from None
        try:
            data = read_rows(path)
        finally:
            for leftover in (path, path + ".lock"):
                Path(leftover).unlink(missing_ok=True)
        return check_rows(data, ids, len(self.layers), self.hidden_size, path, where)


def read_rows(path: str) -> dict[str, torch.Tensor]:
    """A connector file, once its writer released the lock; a missing or damaged file is one line naming it."""
    try:
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # the writer holds LOCK_EX until the file is whole
            return load_file(path, device="cpu")
    except FileNotFoundError as exc:
        raise EngineError(f"hidden states file {exc.filename}: missing (is the connector's folder shared with "
                          "this machine?)") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise EngineError(f"hidden states file {path}: not a whole safetensors file ({exc})") from None


def check_rows(data: dict[str, torch.Tensor], ids: list[int], layers: int, hidden_size: int, path: str,
               where: str) -> torch.Tensor:
    """The file's rows as float32, once they are those of the tokens sent, the layers asked and the width of
    the target."""
    hidden, tokens = data.get("hidden_states"), data.get("token_ids")
    if hidden is None or tokens is None:
        raise EngineError(f"hidden states file {path}: holds {sorted(data)}, not hidden_states and token_ids")
    if tokens.tolist() != ids:
        raise EngineError(f"hidden states file {path}: rows of {tokens.numel()} other tokens, not the {len(ids)} "
                          f"sent to {where}")
    if hidden.dim() != 3 or tuple(hidden.shape) != (len(ids), layers, hidden_size):
        raise EngineError(f"hidden states file {path}: shape {tuple(hidden.shape)}, where {where} should give "
                          f"({len(ids)}, {layers}, {hidden_size}) (tokens, layers, the target's hidden size)")
    return hidden.float()
