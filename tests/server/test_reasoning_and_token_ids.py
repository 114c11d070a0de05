"""A tiny random Qwen3 behind the server, with SmolLM2's tokenizer plus Qwen3's added
tokens and a Qwen3-style template (tools, <tool_call>, thinking opened by the generation
prompt): reasoning_content is split from the content, a constraint starts only once the
reasoning block has ended, the Responses API returns the block as a reasoning item,
enable_thinking is honoured, a tool call right after </think> is parsed, tool calls in
the history are rendered; and, without a tokenizer, a token-id
stream sends every step's ids as they come.

A random model does not close a reasoning block by itself: logit_bias pushes </think>
(so it comes after a few free tokens, seeded), and the grammar then bans it."""

from __future__ import annotations

import json
import re
import shutil

import openai
import pytest

from tests.server.conftest import MODEL_NAME, running_server
from tests.tiny_models import write_tiny_model

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- else %}<think>\n{%- endif %}"
    "{%- endif %}"
)
ASK = [{"role": "user", "content": "Pick a word."}]
WORD = r"[a-z]{3,8}"


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, default_model_dir):
    import transformers

    path = str(tmp_path_factory.mktemp("tiny-qwen3-thinking"))
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])  # added, not special: as in Qwen3
    tok.chat_template = TEMPLATE
    config = transformers.Qwen3Config(
        vocab_size=len(tok) + 6, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
        initializer_range=0.25, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    import torch

    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    with running_server(path, max_model_len=512) as handle:
        yield handle


@pytest.fixture(scope="module")
def toks(thinking_server):
    tok = thinking_server.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")}
    return tok, ids


def _client(handle):
    return openai.OpenAI(base_url=handle.api, api_key="unused", max_retries=0, timeout=120)


def _chat(handle, **kw):
    return _client(handle).chat.completions.create(model=MODEL_NAME, messages=ASK, **kw)


def test_reasoning_split_and_constraint_after_the_block(thinking_server, toks):
    tok, ids = toks
    end = ids["</think>"]
    seen_free_tokens = False
    for seed in range(6):
        r = _chat(thinking_server, max_tokens=40, temperature=1.0, seed=seed, logit_bias={str(end): 9},
                  extra_body={"structured_outputs": {"regex": WORD}, "return_token_ids": True})
        c = r.choices[0]
        out = c.model_extra["token_ids"]
        if end not in out:
            continue  # the block never closed within max_tokens: all reasoning
        cut = out.index(end)
        assert c.message.model_extra["reasoning_content"] == tok.decode(out[:cut])
        assert c.message.model_extra["reasoning"] == c.message.model_extra["reasoning_content"]
        # After </think> the grammar holds: the content is one word, and the bias, which
        # keeps pushing </think>, can no longer place it.
        assert re.fullmatch(WORD, c.message.content), c.message.content
        assert out.count(end) == 1 and c.finish_reason == "stop"
        # Before it, no mask: tokens the grammar would never allow.
        if any(not re.fullmatch(r"[a-z]*", tok.decode([t])) for t in out[:cut]):
            seen_free_tokens = True
        # Streaming splits the same way.
        reasoning = content = ""
        for ch in _client(thinking_server).chat.completions.create(
                model=MODEL_NAME, messages=ASK, max_tokens=40, temperature=1.0, seed=seed, logit_bias={str(end): 9},
                stream=True, extra_body={"structured_outputs": {"regex": WORD}}):
            for d in ch.choices:
                reasoning += d.delta.model_extra.get("reasoning_content") or ""
                content += d.delta.content or ""
        assert (reasoning, content) == (c.message.model_extra["reasoning_content"], c.message.content)
    assert seen_free_tokens


def test_responses_api_returns_reasoning_items(thinking_server, toks):
    """The Responses API: the <think> block is a reasoning item before the message, its
    tokens counted as reasoning tokens; streamed as reasoning_text events into the same
    items."""
    tok, ids = toks
    end = ids["</think>"]
    client = _client(thinking_server)
    for seed in range(6):
        kw = dict(model=MODEL_NAME, input="Pick a word.", max_output_tokens=40, temperature=1.0,
                  extra_body={"seed": seed, "logit_bias": {str(end): 9}, "structured_outputs": {"regex": WORD}})
        r = client.responses.create(**kw)
        if r.status != "completed":
            continue  # the block never closed within max_output_tokens
        reasoning, message = r.output
        assert reasoning.type == "reasoning" and message.type == "message"
        text = reasoning.content[0].text
        assert reasoning.content[0].type == "reasoning_text" and text and "</think>" not in text
        assert re.fullmatch(WORD, r.output_text)
        ids_out = tok.encode(text, add_special_tokens=False)
        assert r.usage.output_tokens_details.reasoning_tokens >= 1
        assert r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        assert abs(r.usage.output_tokens_details.reasoning_tokens - (len(ids_out) + 1)) <= 2  # + the </think>
        events = list(client.responses.create(stream=True, **kw))
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == text
        final = events[-1].response
        assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == r.output_text
        # The next turn carries the first (the template renders the answer, not the reasoning).
        follow = client.responses.create(model=MODEL_NAME, input="Another.", max_output_tokens=2,
                                         previous_response_id=r.id)
        assert follow.usage.input_tokens > r.usage.input_tokens + 2
        return
    pytest.fail("no seed closed the reasoning block within max_output_tokens")


def test_enable_thinking_false(thinking_server, toks):
    """The prompt closes the block: no reasoning parsing, the constraint from the first
    token (the pushed </think> is banned at once)."""
    _, ids = toks
    r = _chat(thinking_server, max_tokens=12, temperature=1.0, seed=1, logit_bias={str(ids["</think>"]): 9},
              extra_body={"structured_outputs": {"regex": WORD}, "chat_template_kwargs": {"enable_thinking": False}})
    message = r.choices[0].message
    assert re.fullmatch(WORD, message.content) and "reasoning_content" not in (message.model_extra or {})
    with thinking_server.client() as c:
        on = c.post("/tokenize", json={"messages": ASK}).json()["tokens"]
        off = c.post("/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert ids["<think>"] in on[-2:] and ids["</think>"] not in on[-3:]  # thinking on: the prompt opens the block
    assert ids["</think>"] in off["tokens"][-4:]


def test_tool_call_right_after_think(thinking_server, toks):
    """tool_choice auto with the hermes parser (chosen from the template): a call written
    right after </think> is a tool call, with the reasoning split off, streamed or not."""
    _, ids = toks
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
        "additionalProperties": False}}}]
    # <tool_call> and </tool_call> by token (Lark's <name> syntax): the model writes them
    # as the single tokens it knows, as Qwen3 does.
    grammar = 'start: <tool_call> "\\n{\\"name\\": \\"lookup\\", \\"arguments\\": {\\"q\\": \\"" /[a-z]{1,8}/ "\\"}}\\n" </tool_call>'
    kw = dict(max_tokens=60, temperature=1.0, logit_bias={str(ids["</think>"]): 9}, tools=tools, tool_choice="auto",
              extra_body={"structured_outputs": {"grammar": grammar}})
    for seed in range(4):
        r = _chat(thinking_server, seed=seed, **kw)
        c = r.choices[0]
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {"q"}
        assert c.message.model_extra.get("reasoning_content") is not None
        streamed = {}
        for ch in _client(thinking_server).chat.completions.create(model=MODEL_NAME, messages=ASK, seed=seed,
                                                                   stream=True, **kw):
            for d in ch.choices:
                for t in d.delta.tool_calls or []:
                    streamed[t.index] = streamed.get(t.index, "") + (t.function.arguments or "")
        assert streamed == {0: call.function.arguments}
        return
    pytest.fail("no seed closed the reasoning block within max_tokens")


def test_tool_calls_in_history_are_rendered(thinking_server):
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "lookup", "arguments": '{"q": "tea"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "green"}]
    with thinking_server.client() as c:
        tokens = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
    text = thinking_server.tokenizer.decode(tokens)
    # The arguments reached the template as a mapping (it writes them with tojson).
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "tea"}}\n</tool_call>' in text
    assert "<tool_response>\ngreen\n</tool_response>" in text


@pytest.fixture(scope="module")
def tokenizerless_server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-qwen3-no-tokenizer"))
    write_tiny_model("qwen3", path)
    shutil.rmtree(path + "/tokenizer.json", ignore_errors=True)
    with running_server(path, max_model_len=256) as handle:
        yield handle


def test_token_id_stream_without_tokenizer(tokenizerless_server):
    # 200 tokens: a step of the tiny model takes a few milliseconds, so a dozen tokens can all
    # be produced while a loaded machine keeps the front end off the CPU, and merged into one
    # chunk; two hundred cannot.
    body = {"model": MODEL_NAME, "prompt": [5, 17, 42], "max_tokens": 200, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with tokenizerless_server.client() as c:
        events = [json.loads(line[6:]) for line in c.post("/v1/completions", json=body).text.split("\n\n")
                  if line.startswith("data: {")]
        full = c.post("/v1/completions", json={**body, "stream": False}).json()
    chunks = [e["choices"][0] for e in events if e["choices"]]
    # Ids come as the steps produce them (a chunk may carry several when the client lags),
    # not in one chunk at the end.
    with_ids = [ch for ch in chunks if ch.get("token_ids")]
    assert len(with_ids) >= 3 and with_ids[0]["finish_reason"] is None
    streamed = [t for ch in chunks for t in ch.get("token_ids", [])]
    assert streamed == full["choices"][0]["token_ids"] and len(streamed) == 200
    # Structured outputs need a tokenizer: a clear 400, and the server carries on.
    with tokenizerless_server.client() as c:
        r = c.post("/v1/completions", json={**body, "stream": False, "structured_outputs": {"regex": "a+"}})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
