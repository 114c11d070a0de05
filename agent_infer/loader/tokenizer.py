"""Tokenizer, chat template and end-of-sequence ids of a checkpoint directory."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent_infer.checkpoint_files import ConfigError, read_json_object, require_directory

if TYPE_CHECKING:
    from agent_infer.config import ModelConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# The JSON files a tokenizer directory may hold, each an object: when transformers fails
# with a JSON error of its own ("Expecting value: line 1 column 1"), which names no file,
# the first of these that does not parse is the one to name.
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json")


def _require_tokenizer_directory(path: str) -> None:
    require_directory(path, "tokenizer", "--tokenizer takes the directory holding tokenizer.json / "
                      "tokenizer_config.json", "tokenizer.json")


def tokenizers_only() -> None:
    """Declare torch absent in this process, before transformers is first imported: loading
    a tokenizer then does not import it (transformers imports torch whenever it is installed,
    seconds of CPU and a few hundred MB in every process that only tokenizes, as the
    server's front ends and their text workers do). Does nothing once either is imported."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # importlib's "not installed" marker: `import torch` fails, find_spec is None
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its "PyTorch was not found" notice


def has_tokenizer(path: str) -> bool:
    """Whether the directory `path` holds tokenizer files. A path that is not a directory
    is a ConfigError: a --tokenizer that points nowhere must not quietly mean "no tokenizer"."""
    _require_tokenizer_directory(path)
    return any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def tokenizer_path(tokenizer: str | None, model: str) -> str:
    """Where the engine's tokenizer lives: --tokenizer, else the model's directory."""
    return tokenizer or model


def load_tokenizer_if_any(path: str):
    """The tokenizer of the directory `path`, or None when it holds no tokenizer files."""
    return load_tokenizer(path) if has_tokenizer(path) else None


def load_tokenizer(path: str):
    """The tokenizer of the directory `path`; a damaged one is a ConfigError on one line
    naming the file (or the directory) and what is wrong with it."""
    _require_tokenizer_directory(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers and tokenizers raise many kinds; -v shows the traceback
        raise _tokenizer_error(path, e) from e


def _tokenizer_error(path: str, e: Exception) -> ConfigError:
    """Why the tokenizer in `path` did not load: the first of its JSON files that is not a
    JSON object, else what transformers said, on one line."""
    for name in _TOKENIZER_JSON:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            try:
                read_json_object(file)
            except ConfigError as bad:
                return ConfigError(f"cannot load the tokenizer: {bad}; restore it from the original checkpoint")
    reason = " ".join(str(e).split()) or type(e).__name__
    return ConfigError(f"cannot load the tokenizer in {path}: {reason}")


def generation_config(path: str) -> dict:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    return read_json_object(file)


def _as_ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def eos_token_ids(model_config: ModelConfig, tokenizer) -> set[int]:
    """Union of the tokenizer's EOS, generation_config.json's and config.json's."""
    ids = _as_ids(generation_config(model_config.path).get("eos_token_id"))
    ids |= set(model_config.eos_token_ids)
    if tokenizer is not None:
        ids |= _as_ids(tokenizer.eos_token_id)
    return ids


@dataclass(frozen=True)
class ChatFormatter:
    tokenizer: object
    chat_template: str | None = None  # a template of the request's own (default: the tokenizer's)

    @property
    def template(self) -> str | None:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default")
        return template

    @property
    def tool_arguments_as_dict(self) -> bool:
        """Whether the template takes a tool call's arguments as a mapping (most: they
        `| tojson` it) or pastes them in as text (DeepSeek-V3's concatenates strings)."""
        t = self.template or ""
        return "is string" in t or bool(re.search(r"arguments\s*\|\s*tojson", t)) or "arguments" not in t

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[dict] | None = None, **template_kwargs) -> str:
        if not self.template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        if tools:
            template_kwargs["tools"] = tools
        if continue_final_message:
            template_kwargs["continue_final_message"] = True
        if self.chat_template:
            template_kwargs["chat_template"] = self.chat_template
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
