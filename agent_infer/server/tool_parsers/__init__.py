"""Tool calls in model output, per model family, for `tool_choice: "auto"`.

Each parser is a streaming state machine over the output text: `feed(delta)` returns
events (content text, a call's start with its id and name, a fragment of a call's
arguments), `finish()` flushes what was held back. `extract(text)` runs the same machine
over a whole output, so a streamed call always reassembles into the non-streamed one.
A call is reported once its name is known; its arguments are the JSON text the model
wrote for them ("{}" when it wrote none: parameterless tools).

Formats:
* `hermes` (Qwen2.5, Qwen3, QwQ): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number;
* `llama3_json` (Llama 3.1/3.2): the whole output is `{"name": ..., "parameters": {...}}`,
  maybe after `<|python_tag|>`, several separated by `;`;
* `deepseek_v3` (DeepSeek-V3 and V3.1): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`
  (V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`);
* `json_array` (not a model format): what `tool_choice: "required"` makes the model write
  under a grammar, `[{"name": ..., "parameters": {...}}, ...]`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArgs:
    index: int
    text: str


@dataclass
class ContentText:
    text: str


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _inside_json_string(text: str) -> bool:
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = inside
        elif ch == '"':
            inside = not inside
    return inside


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


class _JsonCall:
    """One call written as a JSON object {"name": ..., <args key>: {...}}, growing text by
    text: the name as soon as it is complete, then the arguments' raw text as it comes
    (an unfinished JSON value holds every character after its start)."""

    _decoder = json.JSONDecoder()

    def __init__(self, index: int, arg_keys: tuple[str, ...]):
        self.index = index
        self.text = ""
        self.name: str | None = None
        self.id = new_call_id()
        self._args = re.compile(r'"(?:' + "|".join(map(re.escape, arg_keys)) + r')"\s*:\s*')
        self._args_start: int | None = None
        self._args_end: int | None = None
        self.sent = 0  # argument characters sent

    def feed(self, text: str) -> list:
        self.text += text
        events = []
        if self.name is None:
            m = _NAME.search(self.text)
            if m is None:
                return events
            try:
                self.name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                self.name = m.group(1)
            events.append(ToolCallStart(self.index, self.id, self.name))
        if self._args_start is None:
            m = self._args.search(self.text)
            if m is None or not self.text[m.end():].strip():
                return events  # the value has not started yet
            self._args_start = m.end() + len(self.text[m.end():]) - len(self.text[m.end():].lstrip())
        if self._args_end is None:
            try:
                _, end = self._decoder.raw_decode(self.text, self._args_start)
                self._args_end = end
            except json.JSONDecodeError:
                end = len(self.text.rstrip())
        else:
            end = self._args_end
        chunk = self.text[self._args_start + self.sent: end]
        if chunk:
            self.sent += len(chunk)
            events.append(ToolCallArgs(self.index, chunk))
        return events

    def finish(self) -> list:
        """At the end of the call's text: the rest of the arguments, or "{}" for none."""
        events = self.feed("") if self.name is not None else []
        if self.name is not None and self.sent == 0:
            events.append(ToolCallArgs(self.index, "{}"))
            self.sent = 2
        return events


class ToolParser:
    name = "base"

    def __init__(self):
        self.num_calls = 0

    def feed(self, text: str) -> list:
        raise NotImplementedError

    def finish(self) -> list:
        raise NotImplementedError

    def extract(self, text: str) -> ParsedOutput:
        return collect(self.feed(text) + self.finish())


def collect(events: list) -> ParsedOutput:
    """Events -> the content and the calls they describe."""
    content: list[str] = []
    calls: dict[int, ParsedToolCall] = {}
    for e in events:
        if isinstance(e, ContentText):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = ParsedToolCall(e.id, e.name, "")
        else:
            calls[e.index].arguments += e.text
    text = "".join(content)
    return ParsedOutput(text if text.strip() or not calls else None, [calls[i] for i in sorted(calls)])


class _TaggedParser(ToolParser):
    """Calls between an open and a close tag, content outside them."""

    open_tag = ""
    close_tag = ""

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._call = None  # the call being read, inside the tags

    def _new_call(self):
        call = _JsonCall(self.num_calls, ("arguments", "parameters"))
        return call

    def feed(self, text: str) -> list:
        self._buf += text
        events: list = []
        while self._buf:
            if self._call is None:
                i = self._buf.find(self.open_tag)
                if i < 0:
                    keep = _partial_suffix(self._buf, self.open_tag)
                    out = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    if out:
                        events.append(ContentText(out))
                    return events
                if i:
                    events.append(ContentText(self._buf[:i]))
                self._buf = self._buf[i + len(self.open_tag):]
                self._call = self._new_call()
                continue
            i = self._close_at(self._call.text, self._buf)
            if i < 0:
                keep = _partial_suffix(self._buf, self.close_tag)
                events += self._call.feed(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return events
            events += self._call.feed(self._buf[:i])
            self._buf = self._buf[i + len(self.close_tag):]
            events += self._end_call()
        return events

    def _close_at(self, seen: str, buf: str) -> int:
        """Where the close tag is in `buf` (after the call's text `seen`), skipping any
        inside a JSON string: arguments may well contain the tag's text."""
        start = 0
        while True:
            i = buf.find(self.close_tag, start)
            if i < 0 or not _inside_json_string(seen + buf[:i]):
                return i
            start = i + 1

    def _end_call(self) -> list:
        call, self._call = self._call, None
        events = call.finish()
        if call.name is None:  # not a call after all: give its text back as content
            return [ContentText(self.open_tag + call.text + self.close_tag)]
        self.num_calls += 1
        return events

    def finish(self) -> list:
        events: list = []
        if self._call is not None:
            events += self._call.feed(self._buf)
            self._buf = ""
            call, self._call = self._call, None
            events += call.finish()
            if call.name is None:
                events.append(ContentText(self.open_tag + call.text))
            else:
                self.num_calls += 1
        elif self._buf:
            events.append(ContentText(self._buf))
            self._buf = ""
        return events


class HermesToolParser(_TaggedParser):
    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"


class _JsonSequenceParser(ToolParser):
    """A whole output of JSON call objects (Llama 3's format, or a JSON array under the
    `required` grammar), separated by `separator`. An output that does not start with a
    call object (after `prefix`, whitespace) is content."""

    prefix = ""
    separator = ";"
    array = False

    def __init__(self):
        super().__init__()
        self._mode = "start"  # start | calls | content
        self._buf = ""
        self._call: _JsonCall | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> list:
        events: list = []
        if self._mode == "start":
            self._buf += text
            stripped = self._buf.lstrip()
            if self.prefix and stripped.startswith(self.prefix):
                stripped = stripped[len(self.prefix):].lstrip()
            elif self.prefix and self.prefix.startswith(stripped):
                return events  # maybe the prefix, not complete yet
            if not stripped:
                return events
            opener = "[" if self.array else "{"
            if not stripped.startswith(opener):
                self._mode = "content"
                text, self._buf = self._buf, ""
                return [ContentText(text)]
            self._mode = "calls"
            text, self._buf = (stripped[1:] if self.array else stripped), ""
        if self._mode == "content":
            return [ContentText(text)] if text else []
        # calls: split the text at object boundaries, tracking JSON strings and depth.
        start = 0
        for i, ch in enumerate(text):
            if self._call is None:
                if ch == "{":
                    self._call = _JsonCall(self.num_calls, ("parameters", "arguments"))
                    self._depth, self._in_string, self._escape = 0, False, False
                    start = i
                else:
                    continue  # separators, whitespace, the array's brackets
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "{":
                self._depth += 1
            elif ch == "}":
                self._depth -= 1
                if self._depth == 0:
                    events += self._call.feed(text[start: i + 1])
                    events += self._close()
                    start = i + 1
        if self._call is not None and start < len(text):
            events += self._call.feed(text[start:])
        return events

    def _close(self) -> list:
        call, self._call = self._call, None
        events = call.finish()
        if call.name is not None:
            self.num_calls += 1
        return events

    def finish(self) -> list:
        if self._mode == "start":
            text, self._buf = self._buf, ""
            return [ContentText(text)] if text else []
        return self._close() if self._call is not None else []


class Llama3JsonToolParser(_JsonSequenceParser):
    name = "llama3_json"
    prefix = "<|python_tag|>"


class JsonArrayToolParser(_JsonSequenceParser):
    name = "json_array"
    array = True
    separator = ","


_V3_HEAD = re.compile(r"\s*([^\n`]+?)\s*\n\s*```(?:json)?[ \t]*\n")


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3 (name after `function<｜tool▁sep｜>`, arguments in a ```json fence) and
    V3.1 (name before `<｜tool▁sep｜>`, bare arguments)."""

    name = "deepseek_v3"
    calls_begin = "<｜tool▁calls▁begin｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._state = "content"  # content | calls | head | args
        self._name: str | None = None
        self._id = ""
        self._terminator = ""
        self._sent = 0

    def feed(self, text: str) -> list:
        self._buf += text
        events: list = []
        while True:
            if self._state == "content":
                i = self._buf.find(self.calls_begin)
                if i < 0:
                    keep = _partial_suffix(self._buf, self.calls_begin)
                    if len(self._buf) > keep:
                        events.append(ContentText(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                if i:
                    events.append(ContentText(self._buf[:i]))
                self._buf = self._buf[i + len(self.calls_begin):]
                self._state = "calls"
            elif self._state == "calls":
                i = self._buf.find(self.call_begin)
                j = self._buf.find(self.calls_end)
                if j >= 0 and (i < 0 or j < i):
                    self._buf = self._buf[j + len(self.calls_end):]
                    self._state = "content"
                    continue
                if i < 0:
                    return events
                self._buf = self._buf[i + len(self.call_begin):]
                self._state = "head"
            elif self._state == "head":
                i = self._buf.find(self.sep)
                if i < 0:
                    return events
                before, after = self._buf[:i].strip(), self._buf[i + len(self.sep):]
                if before == "function":  # V3: NAME\n```json\n ARGS \n```
                    m = _V3_HEAD.match(after)
                    if m is None:
                        return events  # the fence line is not complete yet
                    self._name, rest, self._terminator = m.group(1), after[m.end():], "```"
                else:  # V3.1: NAME<sep>ARGS<call_end>
                    self._name, rest, self._terminator = before, after, self.call_end
                self._id = new_call_id()
                events.append(ToolCallStart(self.num_calls, self._id, self._name))
                self._buf, self._sent = rest, 0
                self._state = "args"
            else:  # args, up to the terminator
                i = self._buf.find(self._terminator)
                if i < 0:
                    # Hold back a possible partial terminator and the whitespace before it.
                    keep = _partial_suffix(self._buf, self._terminator)
                    out = self._buf[: len(self._buf) - keep].rstrip()
                    keep = len(self._buf) - len(out)
                    if out:
                        events.append(ToolCallArgs(self.num_calls, out))
                        self._sent += len(out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                out = self._buf[:i].rstrip()
                if out:
                    events.append(ToolCallArgs(self.num_calls, out))
                    self._sent += len(out)
                if not self._sent:
                    events.append(ToolCallArgs(self.num_calls, "{}"))
                self._buf = self._buf[i + len(self._terminator):]
                if self._terminator != self.call_end:
                    j = self._buf.find(self.call_end)
                    self._buf = self._buf[j + len(self.call_end):] if j >= 0 else ""
                self.num_calls += 1
                self._state = "calls"

    def finish(self) -> list:
        events: list = []
        if self._state == "content" and self._buf:
            events.append(ContentText(self._buf))
        elif self._state == "args":
            out = self._buf.rstrip()
            if out:
                events.append(ToolCallArgs(self.num_calls, out))
                self._sent += len(out)
            if not self._sent:
                events.append(ToolCallArgs(self.num_calls, "{}"))
            self.num_calls += 1
        self._buf = ""
        return events


class NamedToolParser(ToolParser):
    """`tool_choice: {"function": {"name": ...}}`: the grammar makes the whole output the
    named function's arguments."""

    name = "named"

    def __init__(self, function_name: str):
        super().__init__()
        self.function_name = function_name
        self._id = new_call_id()
        self._sent = 0

    def feed(self, text: str) -> list:
        events: list = []
        if self.num_calls == 0:
            self.num_calls = 1
            events.append(ToolCallStart(0, self._id, self.function_name))
        if self._sent == 0:
            text = text.lstrip()
        if text:
            self._sent += len(text)
            events.append(ToolCallArgs(0, text))
        return events

    def finish(self) -> list:
        events = self.feed("")
        if self._sent == 0:
            events.append(ToolCallArgs(0, "{}"))
        return events


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
}

_BY_MODEL_TYPE = {"qwen2": "hermes", "qwen3": "hermes", "qwen2_vl": "hermes", "qwen2_5_vl": "hermes",
                  "qwen3_moe": "hermes", "llama": "llama3_json", "deepseek_v3": "deepseek_v3",
                  "deepseek_v2": "deepseek_v3"}


def tool_parser_for(name: str | None, chat_template: str | None, model_type: str | None) -> type[ToolParser]:
    """`--tool-call-parser NAME`, or with 'auto' (None) the format the chat template
    writes, else the model family's."""
    if name not in (None, "auto"):
        if name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; known: auto, {', '.join(TOOL_PARSERS)}")
        return TOOL_PARSERS[name]
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesToolParser
    if DeepSeekV3ToolParser.sep in template:
        return DeepSeekV3ToolParser
    if "<|python_tag|>" in template:
        return Llama3JsonToolParser
    return TOOL_PARSERS[_BY_MODEL_TYPE.get(model_type or "", "hermes")]
