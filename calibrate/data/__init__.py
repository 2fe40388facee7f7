"""Dataset sources and format adapters -> Conversation; turn cutting and selection; chat rendering; segments.

The engine's entry points: `load_conversations` -> `cut_turns` -> `select_requests` -> `render_prompt`,
with `dataset_fingerprint` for provenance and `label_segments` for per-segment counts.
"""

from calibrate.data.conversation import (
    Conversation,
    LoadResult,
    Message,
    Problem,
    ReplayRequest,
    ToolCall,
    parse_arguments,
)
from calibrate.data.formats import ALIASES, FORMATS, canonical_format, detect_format
from calibrate.data.loader import load_conversations
from calibrate.data.manifests import DatasetEntry, load_manifest
from calibrate.data.render import (
    THINKING_MODES,
    RenderedPrompt,
    ThinkingSwitch,
    detect_thinking_switch,
    render_prompt,
    thinking_kwargs,
)
from calibrate.data.segments import generation_opens_thinking, label_segments, label_text
from calibrate.data.turns import STRATEGIES, cut_turns, dataset_fingerprint, select_requests

__all__ = [
    "ALIASES", "FORMATS", "STRATEGIES", "THINKING_MODES",
    "Conversation", "DatasetEntry", "LoadResult", "Message", "Problem", "RenderedPrompt", "ReplayRequest",
    "ThinkingSwitch", "ToolCall",
    "canonical_format", "cut_turns", "dataset_fingerprint", "detect_format", "detect_thinking_switch",
    "generation_opens_thinking", "label_segments", "label_text", "load_conversations", "load_manifest",
    "parse_arguments", "render_prompt", "select_requests", "thinking_kwargs",
]
