"""POST /v1/chat/completions: messages rendered by the chat template, tools and
tool_choice (grammar-forced calls for `required` and named choices, parsed calls for
`auto`), reasoning split from the answer, streamed or whole."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from agent_infer.core.client import RequestGroup
from agent_infer.engine.outputs import RequestOutput, TokenLogprob
from agent_infer.sampling_params import SamplingParams, StructuredOutputsParams
from agent_infer.server import protocol as P
from agent_infer.server.chat_output import ChoiceParser, message_of
from agent_infer.server.errors import ApiError
from agent_infer.server.reasoning import ThinkParser, reasoning_parser_for
from agent_infer.server.serving import OpenAIServing, Prompt, template_text
from agent_infer.server.streaming import (
    MARK, TextTemplate, UsageTracker, coalesce, finite, is_shutdown, last_write, sse,
)
from agent_infer.server.tool_parsers import JsonArrayToolParser, NamedToolParser, ToolParser, tool_parser_for
from agent_infer.structured.grammar import close_objects, rebase_refs


class ChatServing(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Parsers are chosen once from the model (or the flags); a request that brings its
        # own chat_template gets them chosen again from that template.
        template = template_text(self.template)
        self.tool_parser_cls = tool_parser_for(self.config.tool_call_parser, template, self.client.model_type)
        self.reasoning_cls = reasoning_parser_for(self.config.reasoning_parser, template)

    async def chat_completions(self, request: Request) -> Response:
        req = await self.parse(request, P.ChatCompletionRequest)
        self.check_model(req.model)
        self.check_stream_options(req)
        if req.stream and req.prompt_logprobs is not None:
            # A chat stream has no place for them (completions sends them in the first chunk).
            raise ApiError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs",
                           code="invalid_value")
        chat = await self.prepare(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        group = await self.submit(self.fan_out([Prompt(None, chat.ids)], chat.params, req.n, rid, req.stream,
                                               req.cache_salt))
        view = ChatView(self, req, rid, int(time.time()), chat.ids, chat.choice_parser, chat.forced_call)
        return await self.respond(request, view, group, req.stream)

    async def prepare(self, req: P.ChatCompletionRequest) -> "PreparedChat":
        """A chat request made ready to run (every other endpoint that speaks in messages
        goes through here too): its prompt rendered and checked, its tools and output
        constraint compiled, its sampling settings, and how to parse its output."""
        if req.top_logprobs and not req.logprobs:  # 0 asks for nothing more: allowed, as in vLLM
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs", code="invalid_value")
        tools = ToolSetup.of(req)
        text, ids = await self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                           req.chat_template_kwargs, tools.template_tools, req.chat_template)
        ids = self.truncate(ids, req.truncate_prompt_tokens, req.truncation_side)
        max_tokens = req.resolved_max_tokens
        self.check_length(len(ids), max_tokens, "messages")
        reasoning_cls = self.reasoning_cls
        tool_parser_cls = self.tool_parser_cls
        if req.chat_template is not None:
            reasoning_cls = reasoning_parser_for(self.config.reasoning_parser, req.chat_template)
            tool_parser_cls = tool_parser_for(self.config.tool_call_parser, req.chat_template, self.client.model_type)
        if ThinkParser.prompt_state(text) is False:
            reasoning_cls = None  # the prompt closed the block: the model was told not to think
        prompt_in_reasoning = bool(reasoning_cls and ThinkParser.prompt_state(text))
        constraint = self.output_constraint(req)
        if tools.constraint is not None:
            if constraint is not None:
                raise ApiError(400, f"tool_choice {tools.choice_label} and response_format/structured_outputs "
                                    f"cannot be combined", param="tool_choice", code="invalid_value")
            constraint = tools.constraint
        if constraint is not None and reasoning_cls is not None:
            think = self.think_token_ids()
            if think is not None:  # the constraint waits out a reasoning block
                constraint = replace(constraint, reasoning=think)
        param = "tools" if tools.constraint is not None else (
            "response_format" if req.response_format else "structured_outputs")
        await self.compile(constraint, param)
        if tools.choice in ("auto", "none") and tools.schemas:
            # Under "required" or a named choice the schemas are compiled into the grammar;
            # a schema that cannot be compiled is the same 400 whichever the choice.
            for schema in tools.schemas:
                await self.compile(StructuredOutputsParams(json=schema), "tools")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs, constraint)

        def choice_parser(with_tools: bool = True) -> ChoiceParser | None:
            reasoning = reasoning_cls(prompt_in_reasoning) if reasoning_cls is not None else None
            parser = tools.parser(tool_parser_cls) if with_tools else None
            return ChoiceParser(reasoning, parser) if reasoning is not None or parser is not None else None

        return PreparedChat(ids, params, choice_parser, tools.forced)


@dataclass(frozen=True)
class PreparedChat:
    ids: list[int]
    params: SamplingParams
    choice_parser: Callable[..., ChoiceParser | None]  # (with_tools=True): one per choice; None: plain text
    forced_call: bool  # the grammar forces a tool call (a named or required tool_choice)


@dataclass
class ToolSetup:
    """What a chat request's tools and tool_choice ask of the template, the grammar and
    the output parser."""

    template_tools: list[dict] | None
    choice: str  # none | auto | required | named
    named: str | None = None
    constraint: StructuredOutputsParams | None = None
    schemas: list[dict] | None = None  # each tool's arguments schema, as a forced call would be held to it

    @property
    def forced(self) -> bool:
        """The grammar forces a call (a named or required choice)."""
        return self.constraint is not None

    @property
    def choice_label(self) -> str:
        return f"{{'function': {self.named!r}}}" if self.choice == "named" else repr(self.choice)

    @staticmethod
    def of(req: P.ChatCompletionRequest) -> "ToolSetup":
        tools = req.tools or []
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        named = None
        if isinstance(choice, P.NamedToolChoice):
            named, choice = choice.function.name, "named"
        if choice != "none" and not tools:
            raise ApiError(400, f"tool_choice {choice!r} needs 'tools'", param="tool_choice", code="invalid_value")
        template_tools = [t.model_dump(by_alias=True, exclude_none=True) for t in tools] or None
        by_name = {t.function.name: t.function for t in tools}
        setup = ToolSetup(template_tools, choice, named, schemas=[_parameters_schema(t.function) for t in tools])
        if choice == "named":
            if named not in by_name:
                raise ApiError(400, f"tool_choice names {named!r}, which is not among the tools "
                                    f"({', '.join(by_name)})", param="tool_choice", code="invalid_value")
            setup.constraint = StructuredOutputsParams(json=_parameters_schema(by_name[named]))
        elif choice == "required":
            setup.constraint = StructuredOutputsParams(json=_required_calls_schema(tools, req.parallel_tool_calls))
        return setup

    def parser(self, auto_cls) -> ToolParser | None:
        if self.choice == "auto":
            return auto_cls()
        if self.choice == "required":
            return JsonArrayToolParser()
        if self.choice == "named":
            return NamedToolParser(self.named)
        return None


def _echoed_text(req: P.ChatCompletionRequest) -> str:
    """With `echo`, the text the content starts with: the last message's, when it is the
    assistant's (a prefill the model continues); nothing otherwise."""
    last = req.messages[-1]
    return last.text if req.echo and last.role == "assistant" else ""


def _parameters_schema(function: P.FunctionDefinition) -> dict:
    """A function's parameters schema for the grammar of a forced call: its objects closed
    (no argument the function does not declare, whether or not it said strict), and a
    parameterless function takes exactly {}."""
    params = function.parameters
    if not params:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    schema = dict(params)
    schema.setdefault("type", "object")
    return close_objects(schema)


def _required_calls_schema(tools: list[P.ChatTool], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of one or more calls, each one of the tools
    with arguments that satisfy its schema (one call only without parallel_tool_calls)."""
    def option(t: P.ChatTool, at: str) -> dict:
        # Each tool's schema keeps its own $defs: its references are rebased to where it sits.
        return {
            "type": "object",
            "properties": {"name": {"const": t.function.name},
                           "parameters": rebase_refs(_parameters_schema(t.function), f"{at}/properties/parameters")},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }

    if len(tools) == 1:
        items = option(tools[0], "/items")
    else:
        items = {"anyOf": [option(t, f"/items/anyOf/{i}") for i, t in enumerate(tools)]}
    schema = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ChatView:
    """Builds /v1/chat/completions responses and stream chunks for one request."""

    def __init__(self, serving: OpenAIServing, req: P.ChatCompletionRequest, rid: str, created: int,
                 prompt_ids: list[int], choice_parser, forced_call: bool = False):
        self.s = serving
        self.req = req
        self.rid = rid
        self.created = created
        self.prompt_ids = prompt_ids
        self.choice_parser = choice_parser  # (with_tools=True) -> ChoiceParser | None (reasoning, tool calls)
        self.forced_call = forced_call
        self.model = serving.config.served_model_name
        self._templates: dict[int, TextTemplate] = {}
        self.echo = _echoed_text(req)

    def _tracker(self) -> UsageTracker:
        return UsageTracker([len(self.prompt_ids)], self.req.n)

    def logprobs_of(self, lps: list[TokenLogprob]) -> P.ChatLogprobs:
        as_ids = self.req.return_tokens_as_token_ids
        content = []
        for lp in lps:
            text = self.s.logprob_token(lp.token_id, as_ids)
            top = [P.TopLogprob(token=self.s.logprob_token(t, as_ids), logprob=finite(v),
                                bytes=list(self.s.token_text(t).encode("utf-8"))) for t, v in lp.top]
            content.append(P.ChatTokenLogprob(token=text, logprob=finite(lp.logprob),
                                              bytes=list(self.s.token_text(lp.token_id).encode("utf-8")),
                                              top_logprobs=top))
        return P.ChatLogprobs(content=content)

    @staticmethod
    def _finish_reason(out: RequestOutput, num_calls: int) -> str | None:
        return "tool_calls" if num_calls and out.finish_reason == "stop" else out.finish_reason

    def parts(self, out: RequestOutput) -> tuple[str | None, str | None, list]:
        """(reasoning, content, tool calls) of a finished choice. A forced call that
        max_tokens cut short is no call: its text goes to content (vLLM's rule), so no
        client runs a tool on broken arguments."""
        cut_call = self.forced_call and out.finish_reason == "length"
        parser = self.choice_parser(with_tools=not cut_call)
        return parser.parse(out.text) if parser is not None else (None, out.text, [])

    def response(self, finals: list[RequestOutput]) -> P.ChatCompletionResponse:
        choices = []
        usage = self._tracker()
        for k, out in enumerate(finals):
            usage.update(k, out)
            reasoning, content, calls = self.parts(out)
            if self.echo:
                content = self.echo + (content or "")
            message, num_calls = message_of(reasoning, content, calls), len(calls)
            choices.append(P.ChatChoice(
                index=k, message=message,
                logprobs=self.logprobs_of(out.logprobs) if self.req.logprobs and out.logprobs is not None else None,
                finish_reason=self._finish_reason(out, num_calls), stop_reason=out.stop_reason,
                token_ids=list(out.token_ids) if self.req.return_token_ids else None))
        first = finals[0] if finals else None
        return P.ChatCompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage.usage(),
            prompt_logprobs=self.s.prompt_logprobs(first.prompt_logprobs)
            if first is not None and self.req.prompt_logprobs is not None else None,
            prompt_token_ids=list(self.prompt_ids) if self.req.return_token_ids else None)

    def _chunk(self, choice: P.ChatChunkChoice | None, usage: P.Usage | None = None,
               prompt_token_ids: list[int] | None = None) -> str:
        fields = dict(id=self.rid, created=self.created, model=self.model, choices=[choice] if choice else [],
                      usage=usage)
        if prompt_token_ids is not None:
            return sse(P.ChatCompletionFirstChunk(**fields, prompt_token_ids=prompt_token_ids))
        return sse(P.ChatCompletionChunk(**fields))

    def _opening(self, k: int, usage: P.Usage | None) -> str:
        """The first chunks of choice k: OpenAI's role chunk (with return_token_ids, the
        prompt's ids, as vLLM sends them), then the echoed text, if any, as a chunk of its own."""
        prompt_ids = list(self.prompt_ids) if self.req.return_token_ids else None
        out = self._chunk(P.ChatChunkChoice(index=k, delta=P.ChatDelta(role="assistant", content="")), usage,
                          prompt_ids)
        if self.echo:
            out += self._chunk(P.ChatChunkChoice(index=k, delta=P.ChatDelta(content=self.echo)), usage)
        return out

    def _text_chunk(self, k: int, text: str) -> str:
        """The chunk of choice k carrying only new content: `_chunk`'s bytes, without pydantic."""
        template = self._templates.get(k)
        if template is None:
            template = self._templates[k] = TextTemplate(
                self._chunk(P.ChatChunkChoice(index=k, delta=P.ChatDelta(content=MARK))))
        return template.fill(text)

    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        total = len(group.request_ids)
        sent_logprobs = [0] * total
        usage = self._tracker()
        continuous = self.req.continuous_usage
        parsers = [self.choice_parser() for _ in range(total)]
        tail: list[str] = []  # sent in the stream's last write
        ended: set[int] = set()  # choices that have finished
        try:
            async with group:
                for k in range(total):
                    yield self._opening(k, usage.choice_usage(k) if continuous else None)
                while batch := await group.next_batch():
                    events = []
                    for k, text, out, ids in coalesce(batch):
                        usage.update(k, out)
                        if out.finished:
                            ended.add(k)
                        logprobs = None
                        if self.req.logprobs and out.logprobs is not None and len(out.logprobs) > sent_logprobs[k]:
                            logprobs = self.logprobs_of(out.logprobs[sent_logprobs[k]:])
                            sent_logprobs[k] = len(out.logprobs)
                        parser = parsers[k]
                        if parser is None:
                            delta = P.ChatDelta(content=text) if text else None
                            plain = True
                        else:
                            parts = parser.feed(text, final=out.finished)
                            delta = parts.delta()
                            plain = not (parts.reasoning or parts.tool_events)
                        # With return_token_ids every chunk has its new ids (maybe none), as in vLLM.
                        token_ids = list(ids) if self.req.return_token_ids else None
                        if not (delta or out.finished or logprobs or token_ids):
                            continue
                        if plain and delta and logprobs is None and not out.finished and not continuous \
                                and token_ids is None:
                            events.append(self._text_chunk(k, delta.content))  # the common case, per token
                            continue
                        num_calls = parser.num_calls if parser is not None else 0
                        events.append(self._chunk(P.ChatChunkChoice(
                            index=k, delta=delta or P.ChatDelta(), logprobs=logprobs,
                            finish_reason=self._finish_reason(out, num_calls) if out.finished else None,
                            stop_reason=out.stop_reason if out.finished else None, token_ids=token_ids),
                            usage.choice_usage(k) if continuous else None))
                    if group.finished:  # the last chunks go out in one write with what ends the stream
                        tail = events
                    elif events:
                        yield "".join(events)
            if self.req.include_usage:
                tail.append(self._chunk(None, usage.usage()))
        except Exception as e:
            ending = [self._chunk(P.ChatChunkChoice(index=k, delta=P.ChatDelta(), finish_reason="abort"))
                      for k in range(total) if k not in ended] if is_shutdown(e) else []
            yield last_write(tail, e, ending)
            return
        yield last_write(tail)
