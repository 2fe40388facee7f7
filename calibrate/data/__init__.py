"""Dataset sources and format adapters -> Conversation; turn cutting and selection; chat rendering; segments.

A run reads its data in one streaming pass, `select_from_source` (conversations parsed one at a time, the
selection kept in a bounded heap, the fingerprint accumulated), then `render_prompt`, with `label_segments`
for per-segment counts. `load_conversations` -> `cut_turns` -> `select_requests` / `dataset_fingerprint`
do the same on lists, for data that fits in memory.
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
from calibrate.data.loader import ConversationStream, SourceSpec, load_conversations, open_conversations
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
from calibrate.data.stream import Selection, select_from_source
from calibrate.data.turns import (
    STRATEGIES, Fingerprint, Selector, conversation_requests, cut_turns, dataset_fingerprint, select_requests,
)

__all__ = [
    "ALIASES", "FORMATS", "STRATEGIES", "THINKING_MODES",
    "Conversation", "ConversationStream", "DatasetEntry", "Fingerprint", "LoadResult", "Message", "Problem",
    "RenderedPrompt", "ReplayRequest", "Selection", "Selector", "SourceSpec", "ThinkingSwitch", "ToolCall",
    "canonical_format", "conversation_requests", "cut_turns", "dataset_fingerprint", "detect_format",
    "detect_thinking_switch", "generation_opens_thinking", "label_segments", "label_text", "load_conversations",
    "load_manifest", "open_conversations", "parse_arguments", "render_prompt", "select_from_source",
    "select_requests", "thinking_kwargs",
]
