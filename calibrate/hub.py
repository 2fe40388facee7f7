"""Whether the Hugging Face hub can be reached, asked once before a name is sent there.

Without this, a misspelt model or dataset name that is neither a local path nor a built test model goes to
the hub, and huggingface_hub retries an unreachable one for about 50 s before its error. One TCP connect
with a short timeout answers the question first, so such a name fails in a second with a message that says
where it was looked for.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

DEFAULT_ENDPOINT = "https://huggingface.co"
PROBE_SECONDS = 3.0


def offline_requested() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / TRANSFORMERS_OFFLINE set to a true value."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable(timeout: float = PROBE_SECONDS) -> bool:
    """True when the hub endpoint ($HF_ENDPOINT or huggingface.co) accepts a TCP connection in `timeout` s."""
    if offline_requested():
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout).close()
    except OSError:
        return False
    return True


def looks_like_path(name: str) -> bool:
    """A name written as a file path, so never a hub id (org/name): absolute, ./ ../ ~, more than one
    slash, or a data or weights file suffix."""
    return (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or name.lower().endswith((".gguf", ".json", ".jsonl", ".parquet", ".safetensors", ".bin")))
