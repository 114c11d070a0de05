"""A Responses request as a chat request: input items to chat messages, function tools,
tool_choice and text.format to their chat forms, and output items back to the assistant
message a later turn sees (`previous_response_id`).

Items become messages the way a chat template expects a conversation: a function_call
joins the assistant message before it (parallel calls are one message), a reasoning item
goes with the assistant message after it, a function_call_output is a tool message.
"""

from __future__ import annotations

from typing import Any

from agent_infer.server import protocol_responses as R
from agent_infer.server.errors import ApiError

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def history_messages(input: str | list[dict[str, Any]]) -> list[dict]:
    """The chat messages of a request's `input`."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    messages: list[dict] = []
    reasoning: str | None = None  # waits for the assistant message it belongs to
    for i, item in enumerate(input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, "each input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{where}.role", f"role must be one of {', '.join(_ROLES)}, not {role!r}")
            message = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if item.get("encrypted_content") and not parts:
                raise _bad(where, "encrypted reasoning content is not supported; send the reasoning text")
            reasoning = (reasoning or "") + _text(parts, f"{where}.content")
        elif kind == "item_reference":
            raise _bad(where, "item references are not supported; send the items themselves",
                       code="unsupported_parameter")
        else:
            raise _bad(f"{where}.type", f"input items of type {kind!r} are not supported (messages, function_call, "
                                        f"function_call_output and reasoning are)", code="unsupported_parameter")
    return messages


def chat_body(req: R.ResponsesRequest, history: list[dict]) -> dict:
    """The chat completions body of a Responses request whose conversation is `history`."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    if not messages:
        raise _bad("input", "the input is empty")
    body: dict[str, Any] = {"messages": messages}
    for name in R.PASSED_TO_CHAT:
        value = getattr(req, name)
        if value is not None:
            body[name] = value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        else:
            if fmt.schema_ is None:
                raise _bad("text.format.schema", "text.format json_schema needs a schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": bool(fmt.strict)}}
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if R.INCLUDE_LOGPROBS in (req.include or ()) or req.top_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    return body


def output_messages(items: list) -> list[dict]:
    """A response's output items as the chat messages of the conversation's next turn."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in items:
        if item.type == "reasoning":
            message["reasoning_content"] = "".join(part.text for part in item.content)
        elif item.type == "message":
            message["content"] = "".join(part.text for part in item.content)
        elif item.type == "function_call":
            message.setdefault("tool_calls", []).append({
                "id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    return [message] if len(message) > 2 or message["content"] is not None else []


def _chat_tool(tool: dict, i: int) -> dict:
    kind = tool.get("type")
    if kind != "function":
        raise _bad(f"tools[{i}].type", f"only function tools are supported, not {kind!r}",
                   code="unsupported_parameter")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    if "name" not in function:
        raise _bad(f"tools[{i}].name", "a function tool needs a name")
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _bad("tool_choice", f"tool_choice {choice!r} is not supported: give 'none', 'auto', 'required' or "
                                  f"{{'type': 'function', 'name': ...}}", code="unsupported_parameter")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text(content, where: str) -> str:
    """The text of a string or a list of text parts; other parts (images, files) are refused."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _bad(where, "content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS or kind in ("reasoning_text", "summary_text"):
            texts.append(part.get("text") if kind != "refusal" else part.get("refusal") or "")
        else:
            raise _bad(f"{where}[{j}]", f"only text parts are supported, not {kind!r}", code="unsupported_parameter")
    return "".join(t for t in texts if isinstance(t, str))


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{where}.{key}", f"'{key}' must be a non-empty string")
    return value


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)
