"""Loaded by vLLM, not by calibrate: a hidden-states connector whose copy off the device works on any device.

vLLM's `extract_hidden_states` speculative method stores the target's aux hidden states (the inputs of the
layers `eagle_aux_hidden_state_layer_ids`) in a cache-only layer, and its `ExampleHiddenStatesConnector`
writes each finished request's rows to `<shared_storage_path>/<request id>.safetensors` (`hidden_states`
(tokens, layers, hidden), `token_ids`), handing the path back in the reply's `kv_transfer_params`. That
connector copies the rows off the GPU on a CUDA stream into pinned memory, so on vLLM's CPU build the
engine dies at the first request (`pin_memory=True requires a CUDA or other accelerator backend`).
This subclass replaces only that copy, `_submit_async_write`, by a plain synchronous copy to host memory,
and leaves the rest (which rows, where, the lock a reader waits on, the writer threads) to vLLM.

calibrate launches vLLM with this file's folder on PYTHONPATH and
`"kv_connector_module_path": "calibrate_hidden_states"` (calibrate/engines/hidden_states.py); its folder holds
nothing else, so no module of calibrate shadows one of vLLM's.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Copied:
    """What the stock connector's CUDA event answers, for a copy that was complete when it was made."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CalibrateHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a device-neutral copy of each finished request's hidden states."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks.unsqueeze(1) * self._block_size + torch.arange(self._block_size)).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        tensors = {"hidden_states": rows.to("cpu", copy=True), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # LOCK_EX taken when the request arrived
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
