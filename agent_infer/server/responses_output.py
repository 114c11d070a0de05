"""A response's output items, whole or as the Responses API's typed stream events.

The output text of a choice goes through the chat path's `ChoiceParser` (reasoning,
then tool calls, then content); its parts become items in order: a reasoning item, a
message with one output_text part, one function_call item per call. Streaming opens an
item when its first text arrives and closes it (its `.done` events) when another kind
of output begins or the response ends, so the items of the final `response.completed`
are the ones streamed, with the same ids.
"""

from __future__ import annotations

import json
import uuid

from agent_infer.server import protocol as P
from agent_infer.server import protocol_responses as R
from agent_infer.server.chat_output import ChoiceParts
from agent_infer.server.tool_parsers import ParsedToolCall, ToolCallStart


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(reasoning: str | None, content: str | None, calls: list[ParsedToolCall], status: str,
                 logprobs: list[P.ChatTokenLogprob] | None) -> list[R.OutputItem]:
    """The items of a whole output: reasoning, the message (also when empty, unless
    there are calls), then the calls."""
    items: list[R.OutputItem] = []
    if reasoning:
        items.append(R.ReasoningItem(id=new_item_id("rs"), content=[R.ReasoningText(text=reasoning)],
                                     status=status))
    if content or not calls:
        items.append(R.OutputMessage(id=new_item_id("msg"), status=status,
                                     content=[R.OutputText(text=content or "", logprobs=logprobs)]))
    items.extend(R.FunctionCallItem(id=new_item_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments,
                                    status="completed") for c in calls)
    return items


class ResponseEvents:
    """The stream of one response: every event numbered, items opened and closed as the
    output's kind changes. `feed` and `finish` return the SSE text to send."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[R.OutputItem] = []
        self._open: R.OutputItem | None = None
        self._calls: dict[int, R.FunctionCallItem] = {}  # the parser's call index -> its item

    def event(self, kind: str, **fields) -> str:
        fields = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(fields, ensure_ascii=False)}\n\n"

    def lifecycle(self, kind: str, response: R.ResponseObject) -> str:
        """response.created / in_progress / completed / incomplete / failed."""
        return self.event(kind, response=response.model_dump(mode="json"))

    def feed(self, parts: ChoiceParts, logprobs: list[P.ChatTokenLogprob] | None = None) -> list[str]:
        out: list[str] = []
        if parts.reasoning:
            out += self._text("reasoning", parts.reasoning, None)
        if parts.content:
            out += self._text("message", parts.content, logprobs)
        for e in parts.tool_events:
            if isinstance(e, ToolCallStart):
                out += self._close()
                item = R.FunctionCallItem(id=new_item_id("fc"), call_id=e.id, name=e.name, arguments="",
                                          status="in_progress")
                self._calls[e.index] = item
                out.append(self._added(item))
                continue
            item = self._calls[e.index]
            item.arguments += e.text
            out.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                  output_index=self._index(item), delta=e.text))
        return out

    def finish(self, status: str) -> list[str]:
        """Close the item still open; `status` (completed / incomplete) goes on the
        message and reasoning items. An output with no text at all is one empty message,
        as in a whole response."""
        out = [] if self.items else self._text("message", "", None)
        return out + self._close(status)

    # ---- items ------------------------------------------------------------------------

    def _index(self, item: R.OutputItem) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def _added(self, item: R.OutputItem) -> str:
        self.items.append(item)
        self._open = item
        return self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item=item.model_dump(mode="json"))

    def _text(self, kind: str, text: str, logprobs: list[P.ChatTokenLogprob] | None) -> list[str]:
        out: list[str] = []
        item = self._open
        if item is None or item.type != kind:
            out += self._close()
            if kind == "message":
                item = R.OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
                part = R.OutputText(text="", logprobs=[])
            else:
                item = R.ReasoningItem(id=new_item_id("rs"), content=[], status="in_progress")
                part = R.ReasoningText(text="")
            out.append(self._added(item))
            item.content.append(part)
            out.append(self.event("response.content_part.added", item_id=item.id, output_index=len(self.items) - 1,
                                  content_index=0, part=part.model_dump(mode="json")))
        part = item.content[0]
        part.text += text
        index = len(self.items) - 1
        if not text:
            return out
        if kind == "message":
            lps = [lp.model_dump(mode="json") for lp in logprobs or []]
            part.logprobs.extend(logprobs or [])
            out.append(self.event("response.output_text.delta", item_id=item.id, output_index=index,
                                  content_index=0, delta=text, logprobs=lps))
        else:
            out.append(self.event("response.reasoning_text.delta", item_id=item.id, output_index=index,
                                  content_index=0, delta=text))
        return out

    def _close(self, status: str = "completed") -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._index(item)
        out: list[str] = []
        if item.type == "function_call":
            item.status = "completed"
            out.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                  name=item.name, arguments=item.arguments))
        else:
            part = item.content[0]
            item.status = status
            if item.type == "message":
                out.append(self.event("response.output_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=part.text,
                                      logprobs=[lp.model_dump(mode="json") for lp in part.logprobs or []]))
            else:
                out.append(self.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=part.text))
            out.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                  content_index=0, part=part.model_dump(mode="json")))
        out.append(self.event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")))
        return out
