"""Bad requests get the right 4xx with OpenAI's error JSON, and never disturb the server."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]
LONG_PROMPT_IDS = [100] * (MAX_MODEL_LEN + 10)
BAD_SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": "five"}}}}}


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2, **fields}


def _response(**fields) -> dict:
    return {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, **fields}


# (case id, method, path, body: dict -> JSON, bytes -> sent as is, status, param, words in the message)
CASES = [
    # wrong types (no coercion: "5" is not 5, true is not 1)
    ("max_tokens-string", "POST", COMPLETIONS, _completion(max_tokens="5"), 400, "max_tokens", ["max_tokens"]),
    ("temperature-string", "POST", COMPLETIONS, _completion(temperature="hot"), 400, "temperature", ["temperature"]),
    ("n-bool", "POST", COMPLETIONS, _completion(n=True), 400, "n", []),
    ("prompt-number", "POST", COMPLETIONS, _completion(prompt=42), 400, "prompt", ["prompt"]),
    ("prompt-mixed-list", "POST", COMPLETIONS, _completion(prompt=[1, "a"]), 400, "prompt", ["token"]),
    ("stop-number", "POST", COMPLETIONS, _completion(stop=3), 400, "stop", ["stop"]),
    ("stream-string", "POST", COMPLETIONS, _completion(stream="yes"), 400, "stream", []),
    ("messages-not-list", "POST", CHAT, _chat(messages="hi"), 400, "messages", []),
    ("message-content-number", "POST", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages",
     ["content"]),
    ("message-empty-role", "POST", CHAT, _chat(messages=[{"role": "", "content": "x"}]), 400, "messages", ["role"]),
    ("message-role-number", "POST", CHAT, _chat(messages=[{"role": 3, "content": "x"}]), 400, "messages", ["role"]),
    ("refusal-part-from-user", "POST", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "refusal", "refusal": "no"}]}]), 400, "messages", ["refusal", "assistant"]),
    ("chat-logprobs-int", "POST", CHAT, _chat(logprobs=3), 400, "logprobs", []),
    # out-of-range values
    ("max_tokens-negative", "POST", COMPLETIONS, _completion(max_tokens=-1), 400, "max_tokens", ["max_tokens"]),
    ("max_tokens-zero", "POST", CHAT, _chat(max_tokens=0), 400, "max_tokens", []),
    ("max_tokens-zero-without-echo", "POST", COMPLETIONS, _completion(max_tokens=0), 400, "max_tokens", ["echo"]),
    ("max_tokens-huge", "POST", COMPLETIONS, _completion(max_tokens=10**12), 400, "max_tokens",
     [str(MAX_MODEL_LEN), str(10**12)]),
    ("max_completion_tokens-huge", "POST", CHAT, _chat(max_completion_tokens=100000), 400, "max_tokens",
     [str(MAX_MODEL_LEN)]),
    ("n-zero", "POST", COMPLETIONS, _completion(n=0), 400, "n", []),
    ("n-too-many", "POST", CHAT, _chat(n=1000), 400, "n", []),
    ("temperature-negative", "POST", COMPLETIONS, _completion(temperature=-0.5), 400, "temperature", ["temperature"]),
    ("top_p-zero", "POST", CHAT, _chat(top_p=0.0), 400, "top_p", ["top_p"]),
    ("presence_penalty-big", "POST", COMPLETIONS, _completion(presence_penalty=5), 400, "presence_penalty", []),
    ("logprobs-too-many", "POST", COMPLETIONS, _completion(logprobs=21), 400, "logprobs", []),
    ("top_logprobs-too-many", "POST", CHAT, _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", []),
    ("top_logprobs-without-logprobs", "POST", CHAT, _chat(top_logprobs=2), 400, "top_logprobs", []),
    ("chat-stream-prompt_logprobs", "POST", CHAT, _chat(stream=True, prompt_logprobs=1), 400, "prompt_logprobs",
     ["stream"]),
    ("chat-stream-prompt_logprobs-zero", "POST", CHAT, _chat(stream=True, prompt_logprobs=0), 400, "prompt_logprobs",
     ["stream"]),
    ("token-id-out-of-vocab", "POST", COMPLETIONS, _completion(prompt=[1, 10**9]), 400, "prompt", ["token"]),
    ("negative-stop-token-id", "POST", COMPLETIONS, _completion(stop_token_ids=[-3]), 400, "stop_token_ids", []),
    # structure
    ("invalid-json", "POST", COMPLETIONS, b'{"model": "x", "prompt": ', 400, None, ["JSON"]),
    ("json-nan", "POST", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, None, ["NaN"]),
    ("json-array", "POST", CHAT, b"[1, 2, 3]", 400, None, ["object"]),
    ("empty-body", "POST", COMPLETIONS, b"", 400, None, ["JSON"]),
    ("non-utf8", "POST", COMPLETIONS, b'{"prompt": "caf\xe9"}', 400, None, ["UTF-8"]),
    # fields we cannot honour are refused by name (unknown ones are ignored: test_lenient_fields)
    ("legacy-functions", "POST", CHAT, _chat(functions=[{"name": "f"}]), 400, "functions", ["tools"]),
    ("suffix", "POST", COMPLETIONS, _completion(suffix="end"), 400, "suffix", ["suffix"]),
    ("best_of", "POST", COMPLETIONS, _completion(best_of=3), 400, "best_of", ["best_of"]),
    ("audio-modality", "POST", CHAT, _chat(modalities=["text", "audio"]), 400, "modalities", ["text"]),
    ("image-part", "POST", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages", ["content"]),
    ("logprob_token_ids", "POST", CHAT, _chat(logprobs=True, logprob_token_ids=[5, 7]), 400, "logprob_token_ids",
     ["top_logprobs"]),
    ("logprob_token_ids-empty", "POST", COMPLETIONS, _completion(logprobs=1, logprob_token_ids=[]), 400,
     "logprob_token_ids", []),
    ("truncation_side-bad", "POST", COMPLETIONS, _completion(truncate_prompt_tokens=3, truncation_side="middle"), 400,
     "truncation_side", ["left", "right"]),
    ("beam-search", "POST", COMPLETIONS, _completion(use_beam_search=True), 400, "use_beam_search", ["beam"]),
    ("bad_words", "POST", CHAT, _chat(bad_words=["no"]), 400, "bad_words", ["logit_bias"]),
    # cache_salt keeps tenants apart; an empty one would silently share
    ("cache_salt-empty", "POST", COMPLETIONS, _completion(cache_salt=""), 400, "cache_salt", []),
    ("cache_salt-empty-chat", "POST", CHAT, _chat(cache_salt=""), 400, "cache_salt", []),
    ("cache_salt-number", "POST", CHAT, _chat(cache_salt=5), 400, "cache_salt", []),
    # the Responses API
    ("responses-missing-input", "POST", RESPONSES, {"model": MODEL_NAME}, 400, "input", ["required"]),
    ("responses-empty-input", "POST", RESPONSES, _response(input=[]), 400, "input", ["empty"]),
    ("responses-web-search", "POST", RESPONSES, _response(tools=[{"type": "web_search"}]), 400, "tools[0].type",
     ["function", "web_search"]),
    ("responses-image", "POST", RESPONSES, _response(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]), 400, "input[0].content[0]", ["input_image"]),
    ("responses-item-reference", "POST", RESPONSES, _response(input=[{"type": "item_reference", "id": "msg_1"}]),
     400, "input[0]", ["reference"]),
    ("responses-unknown-item", "POST", RESPONSES, _response(input=[{"type": "computer_call", "id": "c"}]), 400,
     "input[0].type", ["computer_call"]),
    ("responses-call-without-id", "POST", RESPONSES, _response(input=[
        {"type": "function_call_output", "output": "4"}]), 400, "input[0].call_id", ["call_id"]),
    ("responses-conversation", "POST", RESPONSES, _response(conversation="conv_1"), 400, "conversation",
     ["previous_response_id"]),
    ("responses-truncation-auto", "POST", RESPONSES, _response(truncation="auto"), 400, "truncation", ["auto"]),
    ("responses-background-unstored", "POST", RESPONSES, _response(background=True, store=False), 400, "background",
     ["store"]),
    ("responses-background-stream", "POST", RESPONSES, _response(background=True, stream=True), 400, "stream", []),
    ("responses-include", "POST", RESPONSES, _response(include=["code_interpreter_call.outputs", "x.y"]), 400,
     "include", ["x.y"]),
    ("responses-tool-choice", "POST", RESPONSES, _response(tools=[{"type": "function", "name": "f"}],
                                                           tool_choice={"type": "allowed_tools", "tools": []}), 400,
     "tool_choice", ["allowed_tools"]),
    ("responses-json-schema-missing", "POST", RESPONSES, _response(text={"format": {"type": "json_schema",
                                                                                    "name": "x"}}), 400,
     "text.format.schema", ["schema"]),
    ("responses-bad-schema", "POST", RESPONSES, _response(text={"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}), 400, "text.format", ["strin"]),
    ("responses-overlong", "POST", RESPONSES, _response(input=" hello" * MAX_MODEL_LEN), 400, "input",
     [str(MAX_MODEL_LEN)]),
    ("responses-unknown-previous", "POST", RESPONSES, _response(previous_response_id="resp_nope"), 404,
     "previous_response_id", ["resp_nope"]),
    ("responses-get-unknown", "GET", RESPONSES + "/resp_nope", None, 404, "response_id", ["resp_nope"]),
    ("responses-cancel-unknown", "POST", RESPONSES + "/resp_nope/cancel", None, 404, "response_id", []),
    ("responses-delete-unknown", "DELETE", RESPONSES + "/resp_nope", None, 404, "response_id", []),
    ("responses-unknown-model", "POST", RESPONSES, _response(model="gpt-9"), 404, "model", ["gpt-9"]),
    # int64 seeds; token ids inside the vocabulary
    ("seed-2**63", "POST", COMPLETIONS, _completion(seed=2**63), 400, "seed", ["seed"]),
    ("stop-token-outside-vocab", "POST", COMPLETIONS, _completion(stop_token_ids=[10**7]), 400, "stop_token_ids",
     ["token ids"]),
    ("allowed-token-outside-vocab", "POST", CHAT, _chat(allowed_token_ids=[1, 10**7]), 400, "allowed_token_ids", []),
    ("allowed-tokens-empty", "POST", CHAT, _chat(allowed_token_ids=[]), 400, "allowed_token_ids", []),
    ("logit-bias-key", "POST", COMPLETIONS, _completion(logit_bias={"abc": 1}), 400, "logit_bias", ["abc"]),
    ("logit-bias-keys", "POST", CHAT, _chat(logit_bias={"5": 1, "abc": 1, "x7": 2}), 400, "logit_bias",
     ["'abc'", "'x7'"]),
    ("logit-bias-value", "POST", CHAT, _chat(logit_bias={"5": 500}), 400, "logit_bias", ["100"]),
    ("logit-bias-outside-vocab", "POST", CHAT, _chat(logit_bias={str(10**7): 5}), 400, "logit_bias", []),
    ("min-tokens-over-max", "POST", COMPLETIONS, _completion(min_tokens=5, max_tokens=2), 400, "min_tokens", []),
    ("truncate-zero", "POST", COMPLETIONS, _completion(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens", []),
    # structured outputs: the message names the problem
    ("bad-json-schema", "POST", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}), 400, "response_format",
     ["strin"]),
    ("json-schema-missing", "POST", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     400, "response_format", ["schema"]),
    ("unknown-response-format", "POST", CHAT, _chat(response_format={"type": "yaml"}), 400, "response_format", []),
    ("bad-regex", "POST", COMPLETIONS, _completion(structured_outputs={"regex": "a(b"}), 400, "structured_outputs",
     ["regex", "unclosed"]),
    ("bad-grammar", "POST", COMPLETIONS, _completion(structured_outputs={"grammar": "start: foo"}), 400,
     "structured_outputs", ["foo"]),
    ("two-constraints", "POST", CHAT, _chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     400, "structured_outputs", ["one"]),
    ("empty-choice", "POST", COMPLETIONS, _completion(structured_outputs={"choice": []}), 400, "structured_outputs",
     []),
    ("structural-tag", "POST", CHAT, _chat(structured_outputs={"structural_tag": "{}"}), 400, "structured_outputs",
     ["structural_tag"]),
    # tools
    ("tool-choice-without-tools", "POST", CHAT, _chat(tool_choice="required"), 400, "tool_choice", ["tools"]),
    ("tool-choice-unknown-name", "POST", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                     tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice", ["'g'"]),
    ("tool-choice-bad", "POST", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                            tool_choice="sometimes"), 400, "tool_choice", []),
    ("continue-and-generation-prompt", "POST", CHAT, _chat(messages=[*MSG, {"role": "assistant", "content": "Hel"}],
                                                           continue_final_message=True, add_generation_prompt=True),
     400, "continue_final_message", []),
    ("continue-after-user", "POST", CHAT, _chat(continue_final_message=True), 400, "continue_final_message",
     ["assistant"]),
    ("missing-prompt", "POST", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt", ["required"]),
    ("missing-messages", "POST", CHAT, {"model": MODEL_NAME}, 400, "messages", ["required"]),
    ("empty-messages", "POST", CHAT, _chat(messages=[]), 400, "messages", ["empty"]),
    ("empty-prompt", "POST", COMPLETIONS, _completion(prompt=""), 400, "prompt", ["empty"]),
    ("empty-prompt-list", "POST", COMPLETIONS, _completion(prompt=[]), 400, "prompt", ["empty"]),
    ("empty-token-list-in-batch", "POST", COMPLETIONS, _completion(prompt=[[1, 2], []]), 400, "prompt", ["empty"]),
    ("stream_options-without-stream", "POST", COMPLETIONS, _completion(stream_options={"include_usage": True}), 400,
     "stream_options", []),
    ("reserved-template-kwarg", "POST", CHAT, _chat(chat_template_kwargs={"tokenize": True}), 400,
     "chat_template_kwargs", ["tokenize"]),
    # a request's own template is code: refused unless the server was started trusting them
    ("request-chat-template", "POST", CHAT, _chat(chat_template="{{ 'hi' }}"), 400, "chat_template",
     ["--trust-request-chat-template"]),
    ("request-chat-template-tokenize", "POST", "/tokenize", {"messages": MSG, "chat_template": "{{ 'hi' }}"}, 400,
     "chat_template", ["--trust-request-chat-template"]),
    # a tool whose schema cannot be compiled is refused whatever the tool_choice
    ("tool-bad-schema-auto", "POST", CHAT, _chat(tools=[BAD_SCHEMA_TOOL]), 400, "tools", []),
    ("tool-bad-schema-required", "POST", CHAT, _chat(tools=[BAD_SCHEMA_TOOL], tool_choice="required"), 400, "tools",
     []),
    ("lone-surrogate", "POST", COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400, "prompt", ["surrogate"]),
    # overlong prompts: the message states both lengths
    ("overlong-prompt-ids", "POST", COMPLETIONS, _completion(prompt=LONG_PROMPT_IDS, max_tokens=None), 400, "prompt",
     [str(MAX_MODEL_LEN), str(len(LONG_PROMPT_IDS))]),
    ("overlong-prompt-text", "POST", COMPLETIONS, _completion(prompt=" hello" * (MAX_MODEL_LEN + 5), max_tokens=None),
     400, "prompt", [str(MAX_MODEL_LEN), "prompt has"]),
    ("overlong-chat", "POST", CHAT, _chat(messages=[{"role": "user", "content": " hello" * MAX_MODEL_LEN}],
                                          max_tokens=None), 400, "messages", [str(MAX_MODEL_LEN), "prompt has"]),
    ("prompt-exactly-context", "POST", COMPLETIONS, _completion(prompt=[100] * MAX_MODEL_LEN, max_tokens=None), 400,
     "prompt", [f"prompt has {MAX_MODEL_LEN} tokens"]),
    # unknown model / route / method
    ("unknown-model", "POST", COMPLETIONS, _completion(model="gpt-9"), 404, "model", ["gpt-9"]),
    ("unknown-model-chat", "POST", CHAT, _chat(model="gpt-9"), 404, "model", ["gpt-9"]),
    ("unknown-route", "POST", "/v1/embeddings", _completion(), 404, None, []),
    ("wrong-method", "GET", COMPLETIONS, None, 405, None, []),
    # tokenize / detokenize
    ("tokenize-both", "POST", "/tokenize", {"prompt": "x", "messages": MSG}, 400, "prompt", []),
    ("tokenize-neither", "POST", "/tokenize", {}, 400, "prompt", []),
    ("detokenize-bad-id", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens", []),
    ("detokenize-strings", "POST", "/detokenize", {"tokens": ["a"]}, 400, "tokens", []),
]


def _send(client, method: str, path: str, body):
    if body is None:
        return client.request(method, path)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.request(method, path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(idle_server, case):
    _, method, path, body, status, param, words = case
    with idle_server.client() as c:
        r = _send(c, method, path, body)
        assert r.status_code == status, r.text
        payload = r.json()
        assert set(payload) == {"error"}
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param
        for w in words:
            assert w in err["message"], err["message"]
        assert "Traceback" not in r.text
        # Nothing was queued, and the server is fine.
        assert c.get("/health").status_code == 200


def test_server_still_serves_after_bad_requests(idle_server):
    with idle_server.client() as c:
        for case in CASES:
            _send(c, case[1], case[2], case[3])
        assert c.get("/health").status_code == 200
        r = c.post(COMPLETIONS, json=_completion(max_tokens=3, temperature=0))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_oversized_body_is_413(idle_server):
    big = b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}'
    with idle_server.client() as c:
        r = c.post(COMPLETIONS, content=big)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "body_too_large"
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
def test_body_that_is_not_json_is_415(idle_server, content_type):
    """curl -d sends a form content type: such a body is refused, not read as JSON."""
    with idle_server.client() as c:
        r = c.post(COMPLETIONS, content=json.dumps(_completion()).encode(), headers={"content-type": content_type})
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
        ok = c.post(COMPLETIONS, content=json.dumps(_completion()).encode(),
                    headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200


def test_lenient_fields(idle_server, caplog):
    """What SDKs send is accepted: null for a default, an empty logit_bias, "true" for a
    boolean; unknown fields (top level and in a message) are ignored with a log line."""
    body = _chat(tool_choice=None, logit_bias={}, n=None, stream=None, logprobs="true", temperature=0,
                 frobnicate={"a": 1}, messages=[{"role": "user", "content": "hi", "mood": "happy"}])
    with caplog.at_level("INFO", logger="agent_infer.server.protocol"), idle_server.client() as c:
        r = c.post(CHAT, json=body)
        plain = c.post(CHAT, json=_chat(temperature=0, logprobs=True))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    assert r.json()["choices"][0]["logprobs"]["content"]  # "true" meant true
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    assert "frobnicate" in logged and "mood" in logged
