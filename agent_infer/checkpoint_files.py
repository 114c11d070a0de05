"""A checkpoint directory's files, read without torch (the server's front ends and text
workers load tokenizers but no model), and the error for a configuration the engine
cannot run. `agent_infer.config` re-exports these."""

from __future__ import annotations

import json
import os
from typing import Any


class ConfigError(ValueError):
    """A configuration the engine cannot run; the message says what to change."""


def require_directory(path: str, kind: str, takes: str, marker: str) -> None:
    """ConfigError unless `path` is a directory: "{kind} directory not found", or, for a
    file, that the flag takes a directory (`takes`), naming the file's own directory when
    it holds `marker` (someone who passes config.json means the directory around it)."""
    if os.path.isdir(path):
        return
    if not os.path.exists(path):
        raise ConfigError(f"{kind} directory not found: {path}")
    parent = os.path.dirname(os.path.abspath(path))
    hint = f"; {parent} holds {marker}" if os.path.isfile(os.path.join(parent, marker)) else ""
    raise ConfigError(f"{path} is a file, not a directory: {takes}{hint}")


def read_json_object(file: str) -> dict[str, Any]:
    """A JSON file holding an object, as a dict; a file that cannot be read, is not JSON or
    holds something else is a ConfigError naming it."""
    try:
        with open(file) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data
