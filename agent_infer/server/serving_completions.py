"""POST /v1/completions: prompts as text, token ids or lists of them; `echo` (with
max_tokens 0: the prompt and its logprobs alone, how eval harnesses score text),
logprobs, `n` choices per prompt, streamed or whole."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from agent_infer.core.client import RequestGroup
from agent_infer.engine.outputs import RequestOutput, TokenLogprob
from agent_infer.server import protocol as P
from agent_infer.server.errors import ApiError
from agent_infer.server.serving import OpenAIServing, Prompt
from agent_infer.server.streaming import (
    MARK, TextTemplate, UsageTracker, coalesce, finite, is_shutdown, last_write, sse,
)


class CompletionServing(OpenAIServing):
    async def completions(self, request: Request) -> Response:
        req = await self.parse(request, P.CompletionRequest)
        self.check_model(req.model)
        self.check_stream_options(req)
        prompt_only = _prompt_only(req)
        prompts = await self._prompts(req)
        for p in prompts:
            self.check_length(len(p.ids), req.max_tokens, "prompt")
        constraint = self.output_constraint(req)
        await self.compile(constraint, "response_format" if req.response_format else "structured_outputs")
        # OpenAI's default is 16 tokens (the engine stops earlier at the context's end).
        max_tokens = req.max_tokens if req.max_tokens is not None else P.DEFAULT_COMPLETION_MAX_TOKENS
        if prompt_only:  # the engine computes the prompt's logprobs in a step that samples one token
            max_tokens = 1
        params = self.sampling_params(req, max_tokens, req.logprobs, constraint)
        if req.echo and req.logprobs is not None:  # OpenAI's echo + logprobs covers the prompt too
            params = replace(params, prompt_logprobs=max(req.logprobs, params.prompt_logprobs or 0))
        rid = f"cmpl-{uuid.uuid4().hex}"
        group = await self.submit(self.fan_out(prompts, params, req.n, rid, req.stream, req.cache_salt))
        view = CompletionView(self, req, rid, int(time.time()), prompts, prompt_only)
        return await self.respond(request, view, group, req.stream)

    async def _prompts(self, req: P.CompletionRequest) -> list[Prompt]:
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = await self.encode(item, req.add_special_tokens, "prompt") if item else []
                truncated = self.truncate(ids, req.truncate_prompt_tokens, req.truncation_side)
                # A cut prompt's text is no longer the client's: echo decodes the ids.
                prompt = Prompt(item if len(truncated) == len(ids) else None, truncated)
            else:
                self.check_token_ids(item, "prompt")
                prompt = Prompt(None, self.truncate(list(item), req.truncate_prompt_tokens, req.truncation_side))
            if not prompt.ids:
                raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
            prompts.append(prompt)
        return prompts


def _prompt_only(req: P.CompletionRequest) -> bool:
    """Whether the request asks for its prompt alone (echo with max_tokens 0: its text and
    logprobs back, nothing generated). max_tokens 0 without echo asks for nothing."""
    if req.max_tokens != 0:
        return False
    if not req.echo:
        raise ApiError(400, "max_tokens must be at least 1; 0 is allowed only with echo (to get the prompt and "
                            "its logprobs back without generating)", param="max_tokens", code="invalid_value")
    return True


class CompletionView:
    """Builds /v1/completions responses and stream chunks for one request."""

    def __init__(self, serving: OpenAIServing, req: P.CompletionRequest, rid: str, created: int, prompts: list[Prompt],
                 prompt_only: bool = False):
        self.s = serving
        self.req = req
        self.rid = rid
        self.created = created
        self.prompts = prompts
        self.prompt_only = prompt_only
        self.model = serving.config.served_model_name
        self._templates: dict[int, TextTemplate] = {}
        # Without a tokenizer there is no text: each step's token ids are sent instead, as
        # they come (vLLM's token_ids), so a stream is still a stream.
        self.ids_mode = serving.tokenizer is None or req.return_token_ids
        self._sent_prompt_ids: set[int] = set()  # choices whose prompt_token_ids went out (streaming)

    def _prompt_of(self, k: int) -> Prompt:
        return self.prompts[k // self.req.n]

    def _tracker(self) -> UsageTracker:
        return UsageTracker([len(p.ids) for p in self.prompts], self.req.n)

    def _visible(self, out: RequestOutput) -> RequestOutput:
        """What the client sees of an output. For the prompt alone (max_tokens 0), the one
        token the engine sampled is dropped and the choice ends for "length": the zero
        tokens asked for were generated."""
        if not self.prompt_only:
            return out
        return replace(out, token_ids=[], text="", delta_text="", delta_token_ids=[],
                       logprobs=[] if out.logprobs is not None else None,
                       finish_reason="length" if out.finished else None, stop_reason=None)

    def _ids_fields(self, k: int, ids: list[int]) -> dict:
        """A stream chunk's token ids: with return_token_ids (or without a tokenizer) every
        chunk has `token_ids`, its new ids (maybe none), and the first chunk of each choice
        has `prompt_token_ids` (vLLM's rule)."""
        if not self.ids_mode:
            return {}
        fields = {"token_ids": list(ids)}
        if self.req.return_token_ids and k not in self._sent_prompt_ids:
            self._sent_prompt_ids.add(k)
            fields["prompt_token_ids"] = list(self._prompt_of(k).ids)
        return fields

    def _logprobs(self, lps: list[TokenLogprob | None], offset: int, prompt_ids: list[int] | None = None
                  ) -> P.CompletionLogprobs:
        """OpenAI's logprobs object; `prompt_ids` with prompt logprobs, whose first entry is
        None (the first prompt token has nothing before it)."""
        as_ids = self.req.return_tokens_as_token_ids
        out = P.CompletionLogprobs()
        for i, lp in enumerate(lps):
            text = self.s.logprob_token(lp.token_id if lp is not None else prompt_ids[i], as_ids)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = {self.s.logprob_token(t, as_ids): finite(v) for t, v in lp.top}
            top.setdefault(text, finite(lp.logprob))
            out.token_logprobs.append(finite(lp.logprob))
            out.top_logprobs.append(top)
        return out

    def _echo_logprobs(self, k: int, out: RequestOutput) -> P.CompletionLogprobs:
        return self._logprobs(out.prompt_logprobs or [], 0, self._prompt_of(k).ids)

    def _prompt_logprobs(self, out: RequestOutput) -> P.PromptLogprobs | None:
        return self.s.prompt_logprobs(out.prompt_logprobs) if self.req.prompt_logprobs is not None else None

    def response(self, finals: list[RequestOutput]) -> P.CompletionResponse:
        choices = []
        usage = self._tracker()
        for k, out in enumerate(finals):
            out = self._visible(out)
            usage.update(k, out)
            prefix = self.s.prompt_text(self._prompt_of(k)) if self.req.echo else ""
            logprobs = self._logprobs(out.logprobs, len(prefix)) if self.req.logprobs is not None and out.logprobs is not None else None
            if logprobs is not None and self.req.echo:
                echoed = self._echo_logprobs(k, out)
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    setattr(logprobs, name, getattr(echoed, name) + getattr(logprobs, name))
            choices.append(P.CompletionChoice(
                index=k, text=prefix + out.text, logprobs=logprobs, finish_reason=out.finish_reason,
                stop_reason=out.stop_reason, prompt_logprobs=self._prompt_logprobs(out),
                token_ids=list(out.token_ids) if self.ids_mode else None,
                prompt_token_ids=list(self._prompt_of(k).ids) if self.req.return_token_ids else None))
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                    usage=usage.usage())

    def _chunk(self, choice: P.CompletionChoice | None, usage: P.Usage | None = None) -> str:
        return sse(P.CompletionChunk(id=self.rid, created=self.created, model=self.model,
                                      choices=[choice] if choice else [], usage=usage))

    def _text_chunk(self, k: int, text: str) -> str:
        """The chunk of choice k carrying only new text: `_chunk`'s bytes, without pydantic."""
        template = self._templates.get(k)
        if template is None:
            template = self._templates[k] = TextTemplate(self._chunk(P.CompletionChoice(index=k, text=MARK)))
        return template.fill(text)

    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        total = len(group.request_ids)
        sent_logprobs = [0] * total
        offsets = [0] * total
        usage = self._tracker()
        continuous = self.req.continuous_usage
        sent_prompt_lp: set[int] = set()  # choices whose prompt logprobs went out (with their first chunk)
        tail: list[str] = []  # sent in the stream's last write
        ended: set[int] = set()  # choices that have finished
        try:
            async with group:
                # The echo goes first; with logprobs it waits for the prompt's, which come
                # with the request's first output.
                echo_pending = set(range(total)) if self.req.echo else set()
                if self.req.echo and self.req.logprobs is None:
                    for k in range(total):
                        text = self.s.prompt_text(self._prompt_of(k))
                        offsets[k] = len(text)
                        yield self._chunk(P.CompletionChoice(index=k, text=text, **self._ids_fields(k, [])),
                                          usage.choice_usage(k) if continuous else None)
                    echo_pending.clear()
                while batch := await group.next_batch():
                    events = []
                    if self.prompt_only:
                        batch = [(k, self._visible(out)) for k, out in batch]
                    for k, text, out, ids in coalesce(batch):
                        usage.update(k, out)
                        if out.finished:
                            ended.add(k)
                        extra = {}
                        if k in echo_pending:
                            echo_pending.discard(k)
                            prompt_text = self.s.prompt_text(self._prompt_of(k))
                            offsets[k] = len(prompt_text)
                            events.append(self._chunk(P.CompletionChoice(
                                index=k, text=prompt_text, logprobs=self._echo_logprobs(k, out),
                                **self._ids_fields(k, [])), usage.choice_usage(k) if continuous else None))
                        if self.req.prompt_logprobs is not None and out.prompt_logprobs is not None and \
                                k not in sent_prompt_lp:
                            sent_prompt_lp.add(k)
                            extra["prompt_logprobs"] = self._prompt_logprobs(out)
                        logprobs = None
                        if self.req.logprobs is not None and out.logprobs is not None:
                            new = out.logprobs[sent_logprobs[k]:]
                            sent_logprobs[k] = len(out.logprobs)
                            logprobs = self._logprobs(new, offsets[k])
                            offsets[k] += sum(len(t) for t in logprobs.tokens)
                        if not (text or (self.ids_mode and ids) or out.finished or (logprobs and logprobs.tokens)
                                or extra):
                            continue  # text held back (partial character or possible stop string)
                        extra.update(self._ids_fields(k, ids))
                        if logprobs is None and not out.finished and not extra and not continuous:
                            events.append(self._text_chunk(k, text))  # the common case, per token
                            continue
                        events.append(self._chunk(P.CompletionChoice(
                            index=k, text=text, logprobs=logprobs,
                            finish_reason=out.finish_reason if out.finished else None,
                            stop_reason=out.stop_reason if out.finished else None, **extra),
                            usage.choice_usage(k) if continuous else None))
                    if group.finished:  # the last chunks go out in one write with what ends the stream
                        tail = events
                    elif events:
                        yield "".join(events)
            if self.req.include_usage:
                tail.append(self._chunk(None, usage.usage()))
        except Exception as e:
            ending = [self._chunk(P.CompletionChoice(index=k, text="", finish_reason="abort",
                                                     **self._ids_fields(k, [])))
                      for k in range(total) if k not in ended] if is_shutdown(e) else []
            yield last_write(tail, e, ending)
            return
        yield last_write(tail)
