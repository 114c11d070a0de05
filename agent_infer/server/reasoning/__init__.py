"""Reasoning content: the text a model writes inside `<think>...</think>` (Qwen3,
DeepSeek-R1, QwQ) goes to `reasoning_content` (and `reasoning`), the rest to `content`.

One state machine serves streaming and non-streaming alike (`split` feeds it the whole
text), so a streamed response always reassembles into the non-streamed one. A block that
is opened but never closed (the output was cut by max_tokens) stays reasoning: a stream
cannot know, when it sends a delta, that the block will never close.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkParser:
    """`<think>` ... `</think>` (the Qwen3 / DeepSeek-R1 family)."""

    name = "qwen3"
    start = "<think>"
    end = "</think>"

    def __init__(self, prompt_in_reasoning: bool = False):
        # The prompt may already have opened the block (templates that end the generation
        # prompt with "<think>\n"): the output then starts inside it.
        self.state = "thinking" if prompt_in_reasoning else "start"
        self._pending = ""  # text held back: leading whitespace, or a possible partial tag

    @staticmethod
    def prompt_state(prompt_text: str) -> bool | None:
        """Whether a rendered prompt ends inside a reasoning block (True), after a closed
        one (False: the model was told not to think, e.g. enable_thinking=False), or
        neither (None: the model may open one)."""
        tail = prompt_text.rstrip()
        if tail.endswith(ThinkParser.start):
            return True
        if tail.endswith(ThinkParser.end):
            return False
        return None

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        buf = self._pending + text
        self._pending = ""
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if not stripped:
                    self._pending = buf  # only whitespace so far: the block may still open
                    return out
                if stripped.startswith(self.start):
                    self.state = "thinking"
                    buf = stripped[len(self.start):]
                    continue
                if self.start.startswith(stripped):
                    self._pending = buf  # a partial "<think"
                    return out
                self.state = "content"
                continue
            if self.state == "thinking":
                i = buf.find(self.end)
                if i < 0:
                    keep = _partial_suffix(buf, self.end)
                    out.reasoning += buf[: len(buf) - keep]
                    self._pending = buf[len(buf) - keep:]
                    return out
                out.reasoning += buf[:i]
                buf = buf[i + len(self.end):]
                self.state = "after"
                continue
            if self.state == "after":
                # Templates put "\n\n" after </think>; it belongs to neither part.
                stripped = buf.lstrip()
                if not stripped:
                    return out
                buf = stripped
                self.state = "content"
                continue
            out.content += buf
            return out
        return out

    def finish(self) -> ReasoningDelta:
        """What was held back, at the end of the output."""
        buf, self._pending = self._pending, ""
        if self.state == "thinking":
            return ReasoningDelta(reasoning=buf)
        if self.state in ("start", "content"):
            return ReasoningDelta(content=buf)
        return ReasoningDelta()

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when there was no block, content) of a whole output."""
        a, b = self.feed(text), self.finish()
        reasoning = a.reasoning + b.reasoning
        opened = self.state in ("thinking", "after") or reasoning
        return (reasoning if opened else None), a.content + b.content


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek_r1"


REASONING_PARSERS: dict[str, type[ThinkParser]] = {"qwen3": ThinkParser, "deepseek_r1": DeepSeekR1Parser}


def reasoning_parser_for(name: str | None, chat_template: str | None) -> type[ThinkParser] | None:
    """The parser class for `--reasoning-parser NAME`; with 'auto' (or None), one when the
    chat template knows <think> blocks; 'none' turns reasoning parsing off."""
    if name in (None, "auto"):
        return ThinkParser if chat_template and ThinkParser.start in chat_template else None
    if name == "none":
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: auto, none, {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
