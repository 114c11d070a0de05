"""Tool-call and reasoning parsers on text (no model): every output parses the same
whether it comes whole or in deltas of any size, including the cases vLLM users reported
broken: streamed arguments, parameterless tools, several calls in one message, a call
right after </think>, tags split across deltas."""

from __future__ import annotations

import json
import random

import pytest

from agent_infer.server.chat_output import ChoiceParser
from agent_infer.server.reasoning import DeepSeekR1Parser, ThinkParser, reasoning_parser_for
from agent_infer.server.tool_parsers import (
    DeepSeekV3ToolParser,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    ToolCallArgs,
    ToolCallStart,
    collect,
    tool_parser_for,
)


def _pieces(text: str, seed: int, most: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        out.append(text[i:i + n])
        i += n
    return out


def _streamed(make, text: str, seed: int, most: int):
    parser = make()
    events = []
    for piece in _pieces(text, seed, most):
        events += parser.feed(piece)
    events += parser.finish()
    return events


def _calls(out):
    return [(c.name, c.arguments) for c in out.tool_calls]


CASES = [
    # (parser, output, content, [(name, arguments)])
    (HermesToolParser, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                       '"unit": "celsius"}}\n</tool_call>', "Let me check.\n",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (HermesToolParser, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                       '{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>', None,
     [("get_time", "{}"), ("get_weather", '{"city": "Lima"}')]),
    (HermesToolParser, '<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", "{}")]),  # no arguments at all
    (HermesToolParser, '<tool_call>{"name": "q", "arguments": {"s": "a}b \\"</tool_call>\\" {"}}</tool_call>', None,
     [("q", '{"s": "a}b \\"</tool_call>\\" {"}')]),
    (HermesToolParser, "Plain text with a < sign and <tool but no call.", "Plain text with a < sign and <tool but no call.",
     []),
    (HermesToolParser, "<tool_call>not json at all</tool_call> after", "<tool_call>not json at all</tool_call> after", []),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     None, [("f", '{"a": 1}'), ("g", "{}")]),
    (Llama3JsonToolParser, '{"name": "search", "parameters": {"q": "x; y"}}', None, [("search", '{"q": "x; y"}')]),
    (Llama3JsonToolParser, "The answer is {x}.", "The answer is {x}.", []),
    (JsonArrayToolParser, '[{"name": "f", "parameters": {"a": [1, {"b": "}"}]}}, {"name": "g", "parameters": {}}]',
     None, [("f", '{"a": [1, {"b": "}"}]}'), ("g", "{}")]),
    (DeepSeekV3ToolParser, "Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                           '{"location": "Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                           "now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Sure",
     [("get_weather", '{"location": "Tokyo"}'), ("now", "{}")]),
    (DeepSeekV3ToolParser, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Oslo"}'
                           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [("get_weather", '{"location": "Oslo"}')]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_whole_and_streamed_parse_alike(case):
    cls, text, content, calls = CASES[case]
    whole = cls().extract(text)
    assert whole.content == content and _calls(whole) == calls
    for seed in range(6):
        for most in (1, 3, 9):
            events = _streamed(cls, text, seed, most)
            out = collect(events)
            assert (out.content, _calls(out)) == (whole.content, _calls(whole))
            # id and name come first, once per call; then argument fragments only
            starts = [e for e in events if isinstance(e, ToolCallStart)]
            assert [e.index for e in starts] == list(range(len(calls)))
            for e in events:
                if isinstance(e, ToolCallArgs):
                    assert any(s.index == e.index for s in starts[: e.index + 1])
    for name, args in calls:
        json.loads(args)


def test_arguments_stream_as_they_are_written():
    text = '<tool_call>\n{"name": "write", "arguments": {"text": "' + "word " * 30 + '"}}\n</tool_call>'
    events = _streamed(HermesToolParser, text, 0, 4)
    fragments = [e.text for e in events if isinstance(e, ToolCallArgs)]
    assert len(fragments) > 10  # not held until the call ends
    assert json.loads("".join(fragments)) == {"text": "word " * 30}


def test_named_parser():
    out = NamedToolParser("f").extract(' {"a": 1}')
    assert _calls(out) == [("f", '{"a": 1}')] and out.content is None
    assert _calls(NamedToolParser("f").extract("")) == [("f", "{}")]


REASONING = [
    ("<think>\nThe user wants a color.\n</think>\n\nBlue.", False, "\nThe user wants a color.\n", "Blue."),
    ("No thinking here.", False, None, "No thinking here."),
    ("  <think>a</think>b", False, "a", "b"),
    ("<think>cut by max_tokens", False, "cut by max_tokens", ""),  # unclosed: still reasoning
    ("the prompt opened it</think>\n\nanswer", True, "the prompt opened it", "answer"),
    ("<thin", False, None, "<thin"),
    ("a < b and </think", True, "a < b and </think", ""),
]


@pytest.mark.parametrize("case", range(len(REASONING)))
def test_reasoning_whole_and_streamed(case):
    text, in_prompt, reasoning, content = REASONING[case]
    assert ThinkParser(in_prompt).split(text) == (reasoning, content)
    for seed in range(4):
        parser = ThinkParser(in_prompt)
        r = c = ""
        for piece in _pieces(text, seed, 3):
            d = parser.feed(piece)
            r, c = r + d.reasoning, c + d.content
        d = parser.finish()
        assert (r + d.reasoning, c + d.content) == (reasoning or "", content)


def test_tool_call_right_after_think_in_one_choice():
    text = ('<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": '
            '{"q": "tea"}}\n</tool_call>')
    whole = ChoiceParser(ThinkParser(), HermesToolParser()).parse(text)
    assert whole[0] == "\nI should look it up.\n" and whole[1] is None
    assert [(c.name, c.arguments) for c in whole[2]] == [("lookup", '{"q": "tea"}')]
    parser = ChoiceParser(ThinkParser(), HermesToolParser())
    reasoning, args, names = "", "", []
    pieces = _pieces(text, 1, 2)
    for i, piece in enumerate(pieces):
        parts = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning += parts.reasoning
        assert not parts.content.strip()
        for e in parts.tool_events:
            if isinstance(e, ToolCallStart):
                names.append(e.name)
            else:
                args += e.text
    assert (reasoning, names, args) == (whole[0], ["lookup"], '{"q": "tea"}')
    assert parser.num_calls == 1


def test_prompt_state():
    assert ThinkParser.prompt_state("<|im_start|>assistant\n<think>\n") is True
    assert ThinkParser.prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    assert ThinkParser.prompt_state("<|im_start|>assistant\n") is None


def test_parsers_are_chosen_from_the_template_and_model():
    assert tool_parser_for(None, "{% if tools %}<tool_call>{% endif %}", "llama") is HermesToolParser
    assert tool_parser_for("auto", "x <｜tool▁sep｜> y", None) is DeepSeekV3ToolParser
    assert tool_parser_for(None, "<|python_tag|>", "qwen2") is Llama3JsonToolParser
    assert tool_parser_for(None, "plain", "qwen3") is HermesToolParser
    assert tool_parser_for(None, None, "llama") is Llama3JsonToolParser
    assert tool_parser_for("deepseek_v3", "<tool_call>", "qwen3") is DeepSeekV3ToolParser
    with pytest.raises(ValueError, match="known"):
        tool_parser_for("nope", None, None)
    assert reasoning_parser_for(None, "{{ '<think>' }}") is ThinkParser
    assert reasoning_parser_for("auto", "plain") is None
    assert reasoning_parser_for("none", "<think>") is None
    assert reasoning_parser_for("deepseek_r1", None) is DeepSeekR1Parser
