"""The DSML / reasoning parser of ``ds4c serve`` (ds4c/server/toolcalls.py) on scripted text: whole, split at every
character position, one character at a time; malformed blocks; the JSON fallbacks; and render -> parse round
trips through the synthetic model's V4 chat template."""

from __future__ import annotations

import itertools
import json

import pytest

from ds4c.api import Model
from ds4c.server.toolcalls import (
    THINK_END,
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ToolCallDelta,
    json_fallback_call,
)

D = "｜DSML｜"
TOOLS = ("get_weather", "now")
CALL_BLOCK = (f"\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
              f"<{D}parameter name=\"city\" string=\"true\">Paris <b>&</b></{D}parameter>\n"
              f"<{D}parameter name=\"days\" string=\"false\">[1, 2]</{D}parameter>\n</{D}invoke>\n"
              f"<{D}invoke name=\"now\">\n\n</{D}invoke>\n</{D}tool_calls>")


def _ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def merged(pieces, **kw):
    """Feed ``pieces``; returns (reasoning, content, [(id, name, arguments)]) from the deltas alone, and checks
    they agree with the parser's own totals."""
    p = OutputParser(new_id=_ids(), **kw)
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: list[list] = []
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.index == len(calls):
                assert d.id is not None and d.name is not None  # the first piece names the call
                calls.append([d.id, d.name, ""])
            else:
                assert d.id is None and d.name is None
            calls[d.index][2] += d.arguments
    assert (reasoning, content) == (p.reasoning, p.content)
    assert [tuple(c) for c in calls] == [(c.id, c.name, c.arguments) for c in p.tool_calls]
    return reasoning, content, [tuple(c) for c in calls]


def every_split(text, **kw):
    """The parse of ``text`` whole; asserts every 2-piece split and the 1-character feed give the same."""
    want = merged([text], **kw)
    for i in range(len(text) + 1):
        assert merged([text[:i], text[i:]], **kw) == want, i
    assert merged(list(text), **kw) == want
    return want


def test_reasoning_content_and_calls_at_every_split():
    text = "Let me check <the> weather</think>Sure." + CALL_BLOCK
    reasoning, content, calls = every_split(text, thinking=True, tools=TOOLS)
    assert reasoning == "Let me check <the> weather" and content == "Sure."
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris <b>&</b>", "days": [1, 2]}),
                                                         ("now", {})]
    assert [i for i, _, _ in calls] == ["call_0", "call_1"]


def test_no_thinking_no_tools_and_dsml_left_as_text():
    assert every_split("plain </think> text", thinking=False) == ("", "plain </think> text", [])
    # tools not offered (or tool_choice none): the markup stays content
    assert every_split("a" + CALL_BLOCK, thinking=False) == ("", "a" + CALL_BLOCK, [])
    # thinking with no tools: reasoning until </think>, a DSML block is reasoning text
    assert merged(["x" + CALL_BLOCK + "</think>y"], thinking=True) == ("x" + CALL_BLOCK, "y", [])


def test_a_call_block_ends_the_reasoning_and_cut_off_text():
    # the block starts inside the thinking (llama.cpp: a tool-call block is a thinking end too)
    r, c, calls = every_split("hmm" + CALL_BLOCK, thinking=True, tools=TOOLS)
    assert (r, c, [n for _, n, _ in calls]) == ("hmm", "", ["get_weather", "now"])
    # cut off by max_tokens: unterminated reasoning is reasoning; a cut-off call keeps its complete parameters
    assert merged(["still thinking <"], thinking=True, tools=TOOLS) == ("still thinking <", "", [])
    cut = CALL_BLOCK[:CALL_BLOCK.index("<｜DSML｜parameter name=\"days\"") + 20]
    r, c, calls = every_split("ok" + cut, tools=TOOLS)
    assert c == "ok" and [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris <b>&</b>"})]


def test_malformed_blocks_become_content():
    bad_name = f"Hi\n\n<{D}tool_calls>\n<{D}invoke name=\"rm_rf\">\n</{D}invoke>\n</{D}tool_calls>"
    assert every_split(bad_name, tools=TOOLS) == ("", bad_name, [])
    junk = f"<{D}tool_calls>\nnot markup</{D}tool_calls>"
    assert every_split(junk, tools=TOOLS) == ("", junk, [])
    # a good call, then a repeated parameter: the first call stays, the rest is text
    dup = (f"<{D}tool_calls>\n<{D}invoke name=\"now\">\n</{D}invoke>\n<{D}invoke name=\"get_weather\">\n"
           f"<{D}parameter name=\"a\" string=\"true\">1</{D}parameter>\n"
           f"<{D}parameter name=\"a\" string=\"true\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    r, c, calls = every_split(dup, tools=TOOLS)
    assert [(n, json.loads(a)) for _, n, a in calls] == [("now", {}), ("get_weather", {"a": "1"})]
    assert c == f"\n<{D}parameter name=\"a\" string=\"true\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>"
    # string="false" that is not JSON: its text
    loose = f"<{D}tool_calls><{D}invoke name=\"now\"><{D}parameter name=\"t\" string=\"false\">noon</{D}parameter>" \
            f"</{D}invoke></{D}tool_calls>"
    assert json.loads(every_split(loose, tools=TOOLS)[2][0][2]) == {"t": "noon"}


def test_forced_text_is_never_content():
    """tool_choice required: the server writes the block's opening; a model that then writes no call has its own
    text as content, without the opening it never wrote (at every split of its text)."""
    forced = f"\n\n<{D}tool_calls>\n"
    for reply in ("I cannot call a tool.", f"<{D}invoke name=\"rm_rf\">\n</{D}invoke>"):
        for i in range(len(reply) + 1):
            p = OutputParser(tools=TOOLS)
            deltas = p.feed(forced, forced=True) + p.feed(reply[:i]) + p.feed(reply[i:]) + p.finish()
            assert "".join(d.text for d in deltas) == p.content == reply and not p.tool_calls, (reply, i)
    p = OutputParser(thinking=True, tools=TOOLS)   # thinking mode's second part: after the reasoning
    for piece, forced_ in (("hmm", False), (THINK_END, False), (forced, True), ("no call", False)):
        p.feed(piece, forced=forced_)
    p.finish()
    assert (p.reasoning, p.content, p.tool_calls) == ("hmm", "no call", [])
    p = OutputParser(tools=TOOLS)                  # a named function: its invoke forced too; a call parses as ever
    p.feed(forced + f'<{D}invoke name="now">\n', forced=True)
    p.feed(f"</{D}invoke>\n</{D}tool_calls> then text")
    p.finish()
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("now", "{}")] and p.content == " then text"
    named = forced + f'<{D}invoke name="get_weather">\n'  # a named call the model does not write: no call
    for reply in ("t ache", f"<{D}parameter oops"):
        for i in range(len(reply) + 1):
            p = OutputParser(tools=TOOLS)
            deltas = p.feed(named, forced=True) + p.feed(reply[:i]) + p.feed(reply[i:]) + p.finish()
            assert not any(isinstance(d, ToolCallDelta) for d in deltas), (reply, i)
            assert (p.content, p.tool_calls) == (reply, []), (reply, i)
    p = OutputParser(tools=TOOLS)                  # ... and one it does write: returned as ever
    deltas = p.feed(named, forced=True) + p.feed(f'<{D}parameter name="city" string="true">Oslo</{D}parameter>')
    assert [(d.name, d.arguments) for d in deltas] == [("get_weather", ""), (None, '{"city": "Oslo"')]


def test_parallel_false_keeps_the_first_call():
    r, c, calls = every_split(CALL_BLOCK, tools=TOOLS, parallel=False)
    assert [n for _, n, _ in calls] == ["get_weather"] and c == ""


def test_json_fallbacks():
    bare = '  {"function": "get_weather", "parameters": {"city": "Oslo"}}'
    assert every_split(bare, tools=TOOLS) == ("", "", [("call_0", "get_weather", '{"city": "Oslo"}')])
    legacy = '{"function_call": {"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}}'
    assert every_split(legacy, tools=TOOLS)[2] == [("call_0", "now", '{"tz": "UTC"}')]
    legacy_obj = '{"function_call": {"name": "now", "arguments": {"tz": 1}}}'
    assert every_split(legacy_obj, thinking=True, tools=TOOLS) == (legacy_obj, "", [])  # no </think>: reasoning
    assert merged(["r</think>" + legacy_obj], thinking=True, tools=TOOLS)[2] == [("call_0", "now", '{"tz": 1}')]
    # a tool not offered, other JSON, JSON with text around it, or no tools offered: content
    for text in ('{"function": "rm", "parameters": {}}', '{"a": 1}', '{"function": "now"} and more', '[1]'):
        assert every_split(text, tools=TOOLS) == ("", text, []), text
    assert every_split(bare, tools=()) == ("", bare, [])
    assert json_fallback_call('{"function": "now", "parameters": [1]}', TOOLS) is None


@pytest.fixture(scope="module")
def model(tiny_path):
    return Model(tiny_path, max_ctx=64)


@pytest.mark.parametrize("thinking", [False, True])
def test_render_then_parse_round_trip(model, thinking):
    """An assistant turn with content, reasoning and tool calls, rendered by the model's V4 chat template, parses
    back to the same content, reasoning and calls (arguments equal as JSON)."""
    calls = [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
                 {"city": "São Paulo", "days": 3, "opts": {"units": ["C"], "ok": True}, "note": "a\nb"})}},
             {"id": "y", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in TOOLS]
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "need tools", "tool_calls": calls}]
    head = model.apply_chat_template(msgs[:1], tools=tools, thinking=thinking)   # ends with the generation prompt
    full = model.apply_chat_template(msgs, tools=tools, thinking=thinking, add_generation_prompt=False)
    assert full.startswith(head)
    reply = full[len(head):]
    assert reply.endswith("<｜end▁of▁sentence｜>")
    reasoning, content, got = every_split(reply[:-len("<｜end▁of▁sentence｜>")], thinking=thinking, tools=TOOLS)
    assert content == "Checking." and reasoning == ("need tools" if thinking else "")
    assert [(n, json.loads(a)) for _, n, a in got] == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                                       for c in calls]
