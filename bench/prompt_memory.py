"""Peak memory and time of tokenizing one long prompt for a context budget: chunked from its end (what
`render_prompt` does, calibrate.data.prompt_tokens) vs the whole text at once (what it did before).

    python bench/prompt_memory.py [--sizes 1,4,16] [--context 8192] [--model qwen2.5-coder-1.5b-instruct]

The prompt is the real mini-swe-agent trajectories' last prompts, rendered with the model's chat template
and joined until the text is SIZE MB. For each size, two fresh subprocesses load the tokenizer and the text,
then report their peak RSS growth (VmHWM, over the resident memory after the load) and seconds for:
  whole    the peer: `tokenizer(text)` whole, then the last `context` ids and the count;
  chunked  `tail_tokens(tokenizer, text, context)`.
The table prints both, their ratio, and whether the kept ids and the count are identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv" / "original"


def status_mb(field: str) -> float:
    """VmRSS (resident now) or VmHWM (its peak in this program; getrusage's ru_maxrss would count the parent's
    resident memory from before exec) from /proc/self/status."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(field)).split()[1]) / 1024


def child(mode: str, model: str, text_file: str, context: int) -> None:
    """One tokenization in this (fresh) process; prints a JSON line."""
    from calibrate.data.prompt_tokens import tail_tokens, token_ids
    from calibrate.model_files import load_tokenizer

    tokenizer = load_tokenizer(model)
    text = Path(text_file).read_text()
    baseline = status_mb("VmRSS:")
    started = time.perf_counter()
    if mode == "whole":
        ids = token_ids(tokenizer, text)
        kept, total = ids[-context:], len(ids)
    else:
        kept, total = tail_tokens(tokenizer, text, context)
    seconds = time.perf_counter() - started
    print(json.dumps({"grown_mb": status_mb("VmHWM:") - baseline, "seconds": seconds, "total": total,
                      "kept": hashlib.sha256(",".join(map(str, kept)).encode()).hexdigest()}))


def prompt_text(model: str, megabytes: float) -> str:
    from calibrate.data import conversation_requests, load_conversations
    from calibrate.data.render import apply_template
    from calibrate.model_files import load_tokenizer

    tokenizer = load_tokenizer(model)
    parts, size = [], 0
    conversations = load_conversations(str(SAMPLE)).conversations
    while size < megabytes * 2**20:
        for conv in conversations:
            request = conversation_requests(conv)[-1]
            parts.append(apply_template(tokenizer, [m.to_template() for m in request.messages], model_name=model,
                                        what=request.request_id))
            size += len(parts[-1])
            if size >= megabytes * 2**20:
                break
    return "".join(parts)[: int(megabytes * 2**20)]


def run_child(mode: str, model: str, text_file: Path, context: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", model, "--text", str(text_file),
                          "--context", str(context)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16", help="prompt sizes in MB, comma-separated")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--child", choices=["whole", "chunked"])
    parser.add_argument("--text")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.text, args.context)
        return
    table = Table(title=f"{args.model}: one prompt kept to {args.context} tokens")
    for col in ("prompt MB", "tokens", "whole: MB / s", "chunked: MB / s", "memory ratio", "identical"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for size in (float(s) for s in args.sizes.split(",")):
            text_file = Path(tmp) / f"prompt-{size}.txt"
            text_file.write_text(prompt_text(args.model, size))
            whole = run_child("whole", args.model, text_file, args.context)
            chunked = run_child("chunked", args.model, text_file, args.context)
            same = whole["total"] == chunked["total"] and whole["kept"] == chunked["kept"]
            table.add_row(f"{size:g}", f"{whole['total']:,}", f"{whole['grown_mb']:.0f} / {whole['seconds']:.1f}",
                          f"{chunked['grown_mb']:.0f} / {chunked['seconds']:.1f}",
                          f"{whole['grown_mb'] / max(chunked['grown_mb'], 1):.1f}x", "yes" if same else "NO")
    Console().print(table)


if __name__ == "__main__":
    main()
