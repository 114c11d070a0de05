"""A chat choice's output text -> OpenAI message parts: reasoning first (`<think>` blocks
to `reasoning_content`), then tool calls out of what remains, then content.

One `ChoiceParser` per choice, fed the text deltas as they come (streaming) or the whole
text at once (`parse`): both go through the same state machines, so a stream
reassembles into the response a non-streaming request gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent_infer.server import protocol as P
from agent_infer.server.reasoning import ThinkParser
from agent_infer.server.tool_parsers import (
    ContentText,
    ParsedToolCall,
    ToolCallArgs,
    ToolCallStart,
    ToolParser,
    collect,
)


@dataclass
class ChoiceParts:
    reasoning: str = ""
    content: str = ""
    tool_events: list = field(default_factory=list)

    def delta(self) -> P.ChatDelta | None:
        """The stream delta of these parts; None when there is nothing to send."""
        calls: dict[int, P.ToolCallDelta] = {}
        for e in self.tool_events:
            d = calls.get(e.index)
            if d is None:
                d = calls[e.index] = P.ToolCallDelta(index=e.index)
            if isinstance(e, ToolCallStart):
                d.id, d.type = e.id, "function"
                d.function = P.FunctionCallDelta(name=e.name, arguments="")
            else:
                if d.function is None:
                    d.function = P.FunctionCallDelta(arguments="")
                d.function.arguments = (d.function.arguments or "") + e.text
        if not (self.reasoning or self.content or calls):
            return None
        return P.ChatDelta(
            content=self.content or None,
            reasoning_content=self.reasoning or None,
            reasoning=self.reasoning or None,
            tool_calls=[calls[i] for i in sorted(calls)] or None,
        )


class ChoiceParser:
    def __init__(self, reasoning: ThinkParser | None, tools: ToolParser | None):
        self.reasoning = reasoning
        self.tools = tools
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> ChoiceParts:
        parts = ChoiceParts()
        content = text
        if self.reasoning is not None:
            r = self.reasoning.feed(text)
            if final:
                rest = self.reasoning.finish()
                r.reasoning += rest.reasoning
                r.content += rest.content
            parts.reasoning, content = r.reasoning, r.content
        if self.tools is None:
            parts.content = content
            return parts
        events = self.tools.feed(content) if content else []
        if final:
            events += self.tools.finish()
        for e in events:
            if isinstance(e, ContentText):
                parts.content += e.text
            else:
                parts.tool_events.append(e)
                if isinstance(e, ToolCallStart):
                    self.num_calls += 1
        return parts

    def parse(self, text: str) -> tuple[str | None, str | None, list[ParsedToolCall]]:
        """(reasoning, content, tool calls) of a whole output."""
        parts = self.feed(text, final=True)
        reasoning = parts.reasoning if self.reasoning is not None and self.reasoning.state != "start" else None
        if reasoning is None and parts.reasoning:
            reasoning = parts.reasoning
        if self.tools is None:
            return reasoning, parts.content, []
        out = collect([ContentText(parts.content)] + parts.tool_events)
        return reasoning, out.content, out.tool_calls


def message_of(reasoning: str | None, content: str | None, calls: list[ParsedToolCall]) -> P.ChatResponseMessage:
    tool_calls = [P.ToolCallOut(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return P.ChatResponseMessage(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                 tool_calls=tool_calls or None)


__all__ = ["ChoiceParser", "ChoiceParts", "message_of", "ToolCallArgs"]
