"""The inputs of `kv-offload warm`: prompt files and the model argument, checked without
vLLM. Every problem is a ValueError naming the file (and line) and the fix."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class WarmPrompt:
    """One prompt of a warm workload: plain text, or chat messages to render."""

    text: str | None = None
    messages: tuple[dict, ...] | None = None
    cache_salt: str | None = None
    origin: str = ""  # "file:line" or a file name, for messages


def check_model(model: str) -> str:
    """Return ``model`` unchanged if it can be a model; ValueError naming the fix if not.

    A path that exists must be a directory with a config.json; a string that looks like a
    path (starts with /, ., ~) must exist; anything else is taken as a hub name.
    """
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"--model {model} is a file; pass a model directory (with "
                             "config.json) or a Hugging Face model name")
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model} has no config.json; it is not a Hugging Face "
                             "model directory")
    elif model.startswith(("/", ".", "~")):
        raise ValueError(f"model directory {model} does not exist; check --model")
    return model


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"prompt file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise ValueError(f"cannot read prompt file {path}: {exc.strerror}") from None


def _jsonl_prompt(line: str, origin: str) -> WarmPrompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{origin}: not valid JSON ({exc.msg}); write one JSON object "
                         'per line, e.g. {"prompt": "..."}') from None
    salt = obj.get("cache_salt") if isinstance(obj, dict) else None
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"{origin}: cache_salt must be a string")
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
        return WarmPrompt(text=obj["prompt"], cache_salt=salt, origin=origin)
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in messages)):
        return WarmPrompt(messages=tuple(messages), cache_salt=salt, origin=origin)
    raise ValueError(f"{origin}: expected an object with a string field \"prompt\" or a "
                     "non-empty list \"messages\" of {\"role\": ..., \"content\": ...}")


def load_prompts(path: str | os.PathLike) -> list[WarmPrompt]:
    """Read a workload: .jsonl (``prompt`` or chat ``messages``, optional ``cache_salt``),
    .txt (one prompt per non-blank line) or a directory of .txt files (one prompt per
    file, its exact contents). ValueError naming the file and line for every problem."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"prompt file {path} does not exist; check --prompts")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".txt" and p.is_file())
        if not files:
            raise ValueError(f"prompt directory {path} has no .txt files; put one document "
                             "per .txt file in it")
        texts = [(_read_text(f), f.name) for f in files]
        prompts = [WarmPrompt(text=text, origin=name) for text, name in texts if text.strip()]
    elif path.suffix == ".jsonl":
        lines = _read_text(path).splitlines()
        prompts = [_jsonl_prompt(line, f"{path}:{i}") for i, line in enumerate(lines, 1)
                   if line.strip()]
    elif path.suffix == ".txt":
        prompts = [WarmPrompt(text=line, origin=f"{path}:{i}")
                   for i, line in enumerate(_read_text(path).splitlines(), 1) if line.strip()]
    else:
        raise ValueError(f"prompt file {path}: unsupported type {path.suffix or '(none)'!r}; "
                         "use .jsonl, .txt or a directory of .txt files")
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts
