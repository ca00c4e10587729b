"""Tests of the text-in / text-out layer: ``ds4c.Model`` (ds4c.api), the engine choice (ds4c.engine), the
sampling and stopping of ``ds4c.generate`` (top-k, top-p, stop ids, streaming) and ``ds4c generate`` with text
prompts, on the tiny synthetic model (a real byte-level BPE vocabulary, eos id 1)."""

from __future__ import annotations

import os
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import ds4c
from ds4c.api import Completion, CompletionStream, Model
from ds4c.cli import main
from ds4c.engine import open_engine, resolve_engine
from ds4c.errors import Ds4cError, StepError
from ds4c.generate import filter_logits, generate, stream
from ds4c.sources import open_model
from ds4c.reference import Reference
from ds4c.synth_vocab import TOOLS_FOOTER, TOOLS_HEADER

PROMPT = "The quick brown fox"
# "Hi" sampled at temperature 5: seed 10 draws eos (id 1) as its 31st new token (measured on x86 CPUs); the
# eos_case fixture tries other seeds where the arithmetic differs
EOS_PROMPT, EOS_TEMP, EOS_MAX = "Hi", 5.0, 40


@pytest.fixture(scope="module")
def model(tiny_path) -> Model:
    return Model(tiny_path, max_ctx=128)


@pytest.fixture(scope="module")
def full24(model):
    """PROMPT's greedy completion of 24 tokens (shared: tests only read it)."""
    return model.generate(PROMPT, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def eos_case(model) -> tuple[int, int]:
    """(seed, position + 1) of a sampled run of EOS_PROMPT that ends at eos before EOS_MAX tokens."""
    for seed in (10, *range(10), *range(11, 40)):
        c = model.generate(EOS_PROMPT, max_new_tokens=EOS_MAX, temperature=EOS_TEMP, seed=seed)
        if c.stop_reason == "eos":
            return seed, len(c.ids)
    pytest.skip("no seed below 40 draws eos")


@pytest.fixture(scope="module")
def bare_path(tmp_path_factory) -> Path:
    """The tiny model's weights (seed 0) in a file without tokenizer keys, as ds4c wrote before 0.2."""
    from ds4c.config import preset
    from ds4c.gguf_file import write_model
    from ds4c.synth import producer
    from ds4c.tensors import FORMATS

    cfg = preset("tiny")
    return write_model(tmp_path_factory.mktemp("bare") / "bare.gguf", cfg, FORMATS["official"], producer(cfg, 0))


def one_line(e: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, msg
    return msg


# ------------------------------------------------------------------------------------------------ Model

def test_model_is_exported():
    assert ds4c.Model is Model and ds4c.Completion is Completion


def test_tokenize_detokenize_round_trip(model):
    tok = model.tokenizer
    for text in (PROMPT, "def f(x):\n    return x + 1  # ok", "中文 and 日本語のテキスト", "emoji 🙂 é", ""):
        ids = model.tokenize(text)
        assert ids[0] == tok.bos_id == 0
        assert all(isinstance(i, int) and 0 <= i < model.vocab_size for i in ids)
        assert model.detokenize(ids[1:]) == text
        assert model.detokenize(ids, skip_special=True) == text
        assert model.tokenize(text, add_bos=False) == ids[1:]
    assert model.detokenize([0]) == "<｜begin▁of▁sentence｜>"
    assert model.detokenize(torch.tensor([0])) == model.detokenize(iter([0]))  # any iterable of ids
    for bad in (5, "12", None):  # one id or a string is not a sequence of ids (a raw TypeError before)
        with pytest.raises(Ds4cError) as e:
            model.detokenize(bad)
        one_line(e, "expected a sequence of token ids")
    # a control token written in the text is one id
    assert model.tokenize("<｜User｜>hi", add_bos=False)[0] == tok.specials["<｜User｜>"]


def test_generate_greedy_equals_the_generate_function(model, tiny_weights):
    c = model.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    assert isinstance(c, Completion)
    assert c.prompt_ids == model.tokenize(PROMPT)
    ref = Reference(tiny_weights, max_ctx=64)
    want = generate(ref, c.prompt_ids, 12)
    assert c.ids == want.tokens and len(c.ids) == 12
    assert c.stop_reason == "length"
    assert c.text == model.detokenize(c.ids)
    t = c.timings
    assert t.load_s > 0 and t.prefill_s > 0 and t.decode_s > 0
    assert t.decode_tokens_per_s == pytest.approx(11 / t.decode_s)
    assert t.prefill_tokens_per_s == pytest.approx(len(c.prompt_ids) / t.prefill_s)
    # ids in: the same tokens; a text prompt that already starts with bos gets no second one
    assert model.generate(c.prompt_ids, max_new_tokens=12, ignore_eos=True).ids == c.ids
    assert model.generate("<｜begin▁of▁sentence｜>" + PROMPT, max_new_tokens=1).prompt_ids == c.prompt_ids
    assert c.as_dict()["text"] == c.text and c.as_dict()["ids"] == c.ids


def test_streaming_pieces_join_to_the_text(model, full24):
    full = full24
    s = model.generate(PROMPT, max_new_tokens=24, ignore_eos=True, stream=True)
    assert isinstance(s, CompletionStream) and not s.done
    pieces = list(s)
    assert s.done
    assert all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == full.text == s.completion.text
    assert s.completion.ids == full.ids and s.completion.stop_reason == "length"
    assert len(pieces) > 1  # pieces arrive token by token


def test_stream_completion_before_the_end_and_close(model):
    full = model.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
    s = model.generate(PROMPT, max_new_tokens=10, ignore_eos=True, stream=True)
    first = next(s)
    assert full.text.startswith(first)
    assert s.completion.text == full.text and s.completion.ids == full.ids  # ran to the end
    s2 = model.generate(PROMPT, max_new_tokens=10, ignore_eos=True, stream=True)
    got = next(s2)
    c = s2.close()
    assert c.stop_reason == "stop" and c.text == got and 1 <= len(c.ids) < 10
    assert list(s2) == []


def _ascii_stop(text: str) -> str:
    """A short ASCII-letter substring of ``text`` past its first characters (a stop string that is there)."""
    for m in re.finditer(r"[A-Za-z]{2,3}", text):
        if m.start() >= 4:
            return m.group()
    pytest.skip(f"no ASCII stop string in {text!r}")


def test_stop_string_cuts_the_text(model, full24):
    full = full24
    stop = _ascii_stop(full.text)
    c = model.generate(PROMPT, max_new_tokens=24, ignore_eos=True, stop=[stop, "never-in-the-text"])
    assert c.stop_reason == "stop"
    assert c.text == full.text[:full.text.find(stop)]
    assert stop not in c.text
    # ids: up to the token that completed the stop string
    assert c.ids == full.ids[:len(c.ids)]
    assert stop in model.detokenize(c.ids) and stop not in model.detokenize(c.ids[:-1])
    assert len(c.result.tokens) == len(c.ids)
    # streaming: the same text, and no piece ever carried part of the stop string
    s = model.generate(PROMPT, max_new_tokens=24, ignore_eos=True, stop=stop, stream=True)
    pieces = list(s)
    assert "".join(pieces) == c.text and s.completion.stop_reason == "stop" and s.completion.ids == c.ids


def test_stop_string_made_of_several_tokens_is_held_back(model, full24):
    full = full24
    # a stop string spanning the text of two tokens (its start is held back, never emitted)
    for i in range(3, 22):
        a, b = model.detokenize(full.ids[:i]), model.detokenize(full.ids[:i + 2])
        one = model.detokenize(full.ids[:i + 1])
        if (b.startswith(one) and one.startswith(a) and len(one) > len(a) and len(b) > len(one)
                and "\ufffd" not in b[len(a):] and b[len(a):] not in a):
            break
    else:
        pytest.skip("no two consecutive tokens decode to clean text")
    stop = b[len(a):]
    c = model.generate(PROMPT, max_new_tokens=24, ignore_eos=True, stop=[stop], stream=True)
    text = "".join(c)
    assert text == full.text[:full.text.find(stop)] and c.completion.stop_reason == "stop"


def test_stop_at_eos_and_ignore_eos(model, eos_case):
    seed, at = eos_case
    c = model.generate(EOS_PROMPT, max_new_tokens=EOS_MAX, temperature=EOS_TEMP, seed=seed)
    assert c.stop_reason == "eos"
    assert len(c.ids) == at and c.ids[-1] == model.eos_id == 1 and 1 not in c.ids[:-1]
    assert c.text == model.detokenize(c.ids[:-1])  # the eos is not part of the text
    s = model.generate(EOS_PROMPT, max_new_tokens=EOS_MAX, temperature=EOS_TEMP, seed=seed, stream=True)
    assert "".join(s) == c.text and s.completion.stop_reason == "eos"
    g = model.generate(EOS_PROMPT, max_new_tokens=EOS_MAX, temperature=EOS_TEMP, seed=seed, ignore_eos=True)
    assert g.stop_reason == "length" and len(g.ids) == EOS_MAX and g.ids[:at] == c.ids


def test_greedy_stops_at_the_eos_id(tiny_path):
    """Greedy, deterministic on any machine: the tokenizer's eos id set to the 4th greedy token."""
    m = Model(tiny_path, max_ctx=64)
    greedy = m.generate(PROMPT, max_new_tokens=10, ignore_eos=True).ids
    k = greedy.index(greedy[3])
    m.tokenizer._eos = greedy[3]
    c = m.generate(PROMPT, max_new_tokens=10)
    assert c.stop_reason == "eos" and c.ids == greedy[:k + 1] and c.text == m.detokenize(greedy[:k])
    assert m.generate(PROMPT, max_new_tokens=10, ignore_eos=True).ids == greedy


def test_generate_function_stop_ids_and_callback(tiny_weights):
    ref = Reference(tiny_weights, max_ctx=64)
    p = [5, 6, 7]
    base = generate(ref, p, 10)
    assert base.stop_reason == "length" and len(base.tokens) == 10
    stop_tok = base.tokens[3]
    k = base.tokens.index(stop_tok)
    r = generate(ref, p, 10, stop_ids={stop_tok})
    assert r.tokens == base.tokens[:k + 1] and r.stop_reason == "eos"
    assert len(r.step_s) == k
    seen: list[int] = []
    r2 = generate(ref, p, 10, on_token=lambda t: seen.append(t) or len(seen) == 4)
    assert r2.tokens == seen == base.tokens[:4] and r2.stop_reason == "stop"
    r3 = generate(ref, p, 4, on_token=lambda t: len(seen) > 100)
    assert r3.stop_reason == "length" and r3.tokens == base.tokens[:4]
    ts = stream(ref, p, 10)
    assert [next(ts), next(ts)] == base.tokens[:2] and ts.result is None
    res = ts.stop()
    assert res.tokens == base.tokens[:2] and res.stop_reason == "stop" and list(ts) == []
    assert generate(ref, p, 0).stop_reason == "length"
    assert r.as_dict()["stop_reason"] == "eos"


def test_top_k_1_and_tiny_top_p_equal_greedy(model):
    greedy = model.generate(PROMPT, max_new_tokens=10, ignore_eos=True).ids
    assert model.generate(PROMPT, max_new_tokens=10, temperature=1.0, top_k=1, seed=3, ignore_eos=True).ids == greedy
    assert model.generate(PROMPT, max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=4,
                          ignore_eos=True).ids == greedy
    # greedy ignores top-k / top-p
    assert model.generate(PROMPT, max_new_tokens=10, top_k=7, top_p=0.3, ignore_eos=True).ids == greedy


def test_seeded_sampling_is_reproducible(model):
    kw = dict(max_new_tokens=16, temperature=0.9, ignore_eos=True)
    a = model.generate(PROMPT, seed=1, **kw)
    assert model.generate(PROMPT, seed=1, **kw).ids == a.ids
    assert model.generate(PROMPT, seed=2, **kw).ids != a.ids  # 16 draws: equal only by a fluke
    b = model.generate(PROMPT, seed=1, top_k=20, top_p=0.9, **kw)
    assert model.generate(PROMPT, seed=1, top_k=20, top_p=0.9, **kw).ids == b.ids


def test_filter_logits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g)
    assert filter_logits(x, 0.0, 5, 0.5) is x  # greedy: unfiltered
    k = filter_logits(x, 1.0, top_k=5)
    assert (torch.isfinite(k).sum(-1) == 5).all()
    assert torch.equal(k.argmax(-1), x.argmax(-1))
    assert torch.equal(filter_logits(x, 1.0, top_k=0), x) and torch.equal(filter_logits(x, 1.0, top_k=50), x)
    # top-p on a known distribution: probs 0.5, 0.3, 0.15, 0.05
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda tp: torch.isfinite(filter_logits(p, 1.0, top_p=tp))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.8) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(1.0) == [True] * 4
    assert kept(1e-9) == [True, False, False, False]
    # temperature applies before top-p: at T = 100 the distribution is nearly flat
    assert sum(torch.isfinite(filter_logits(p, 100.0, top_p=0.6))[0].tolist()) == 3


def test_sampled_tokens_stay_in_the_top_k(tiny_weights):
    ref = Reference(tiny_weights, max_ctx=64)
    p = [3, 4, 5]
    r = generate(ref, p, 8, temperature=2.0, top_k=3, seed=5)
    ref.reset()
    logits = ref.verify(p, 0)[-1]
    assert r.tokens[0] in torch.topk(logits, 3).indices.tolist()
    for i, t in enumerate(r.tokens[1:]):
        row = ref.decode(r.tokens[i], len(p) + i)[0]
        assert t in torch.topk(row, 3).indices.tolist()


def test_bad_generate_arguments(model):
    for kw, part in ((dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
                     (dict(temperature=-1.0), "temperature"), (dict(max_new_tokens=-1), "max_new_tokens"),
                     (dict(stop=[""]), "stop strings"), (dict(max_new_tokens=200), "max_ctx 128")):
        with pytest.raises(Ds4cError) as e:
            model.generate(PROMPT, **kw)
        one_line(e, part)
    with pytest.raises(Ds4cError) as e:
        model.generate([1, 512])
    one_line(e, "0..511", "512")
    with pytest.raises(Ds4cError) as e:
        model.generate([])
    one_line(e, "at least one token")
    with pytest.raises(Ds4cError) as e:
        model.generate([1, "x"])
    one_line(e, "token ids")


def test_bad_argument_types_are_one_line_errors(model):
    """Issue 28.7: a model path that is not a path, stop strings that are not strings and bools among the prompt
    ids raised Python's raw TypeError (or ran True as id 1)."""
    for bad, found in ((123, "int 123"), (b"model.gguf", "bytes"), (["a.gguf"], "list")):
        with pytest.raises(Ds4cError) as e:
            Model(bad)
        one_line(e, "expected a GGUF file path", found)
    for stop, found in ((5, "int"), ([5], "int"), (["ok", None], "NoneType"), (b"\n", "bytes")):
        with pytest.raises(Ds4cError) as e:
            model.generate(PROMPT, max_new_tokens=2, stop=stop)
        one_line(e, "stop", "str", found)
    for prompt in ([True, 2], [1, False], (True,)):
        with pytest.raises(Ds4cError) as e:
            model.generate(prompt, max_new_tokens=2)
        one_line(e, "token ids", "bool")


def test_file_without_tokenizer_takes_ids_only(bare_path, model):
    bare = Model(bare_path, max_ctx=64)
    assert bare.tokenizer is None and bare.eos_id == 1
    c = bare.generate([5, 6, 7], max_new_tokens=6, ignore_eos=True)
    assert c.text is None and c.ids == model.generate([5, 6, 7], max_new_tokens=6, ignore_eos=True).ids
    for call, part in ((lambda: bare.generate("hello"), "a text prompt"), (lambda: bare.tokenize("x"), "tokenize"),
                       (lambda: bare.detokenize([1]), "detokenize"),
                       (lambda: bare.generate([1], max_new_tokens=2, stop=["a"]), "stop strings"),
                       (lambda: bare.generate([1], max_new_tokens=2, stream=True), "stream")):
        with pytest.raises(Ds4cError) as e:
            call()
        one_line(e, str(bare_path), part, "no tokenizer", "token ids")


# ------------------------------------------------------------------------------------------------ chat

def test_chat_template_and_chat(model, tiny_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert model.apply_chat_template(msgs) == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"
    assert model.apply_chat_template(msgs, thinking=True, reasoning_effort="high") == (
        "<｜begin▁of▁sentence｜>Reasoning Effort: high.\n\nBe brief.<｜User｜>Hi<｜Assistant｜><think>")
    assert model.apply_chat_template(msgs, add_generation_prompt=False).endswith("<｜User｜>Hi")
    c = model.chat(msgs, max_new_tokens=6, ignore_eos=True)
    rendered = model.apply_chat_template(msgs)
    assert c.prompt_ids == model.tokenize(rendered, add_bos=False)  # one bos, control tokens as single ids
    tok = model.tokenizer
    assert c.prompt_ids.count(tok.bos_id) == 1 and tok.specials["<｜Assistant｜>"] in c.prompt_ids
    assert c.ids == model.generate(rendered, max_new_tokens=6, ignore_eos=True).ids
    s = model.chat(msgs, max_new_tokens=6, ignore_eos=True, stream=True)
    assert "".join(s) == c.text
    for bad in ([], "hi", [{"content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(Ds4cError) as e:
            model.apply_chat_template(bad)
        one_line(e, "messages")
    # a template that raises, one that fails, one that mutates, none
    m2 = Model(tiny_path, max_ctx=16)
    m2.tokenizer._chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(Ds4cError) as e:
        m2.chat(msgs)
    one_line(e, "only user turns")
    m2.tokenizer._chat_template = "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"
    with pytest.raises(Ds4cError) as e:
        m2.apply_chat_template(msgs)
    one_line(e, "does not render")
    m2.tokenizer._chat_template = "{{ messages.append(1) }}"  # the sandbox is immutable
    with pytest.raises(Ds4cError) as e:
        m2.apply_chat_template(msgs)
    one_line(e, "does not render")
    m2.tokenizer._chat_template = None
    with pytest.raises(Ds4cError) as e:
        m2.chat(msgs)
    one_line(e, "no tokenizer.chat_template")


def test_chat_template_renders_tools_tool_calls_and_results(model):
    """DeepSeek-V4's official encoding of a tool conversation (encoding_dsv4.py / llama.cpp's V4 template): the
    tools block after the system prompt (schemas one a line, JSON with non-ASCII kept and keys in order), the
    assistant's calls as DSML (str values raw with string="true", others JSON), the results as one user turn."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Météo",
                                               "parameters": {"type": "object", "properties": {"city": {
                                                   "type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Zürich", "days": [1, 2]}'}},
                {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "b", "content": "noon"}]
    schemas = ('{"name": "get_weather", "description": "Météo", "parameters": {"type": "object", "properties": '
               '{"city": {"type": "string"}}, "required": ["city"]}}\n'
               '{"name": "now", "parameters": {"type": "object", "properties": {}}}\n')
    d = "｜DSML｜"
    want = ("<｜begin▁of▁sentence｜>Be brief.\n\n" + TOOLS_HEADER + schemas + TOOLS_FOOTER +
            "<｜User｜>Weather?<｜Assistant｜></think>"
            f"\n\n<{d}tool_calls>\n<{d}invoke name=\"get_weather\">\n"
            f"<{d}parameter name=\"city\" string=\"true\">Zürich</{d}parameter>\n"
            f"<{d}parameter name=\"days\" string=\"false\">[1, 2]</{d}parameter>\n</{d}invoke>\n"
            f"<{d}invoke name=\"now\">\n\n</{d}invoke>\n</{d}tool_calls><｜end▁of▁sentence｜>"
            "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result><｜Assistant｜></think>")
    assert model.apply_chat_template(msgs, tools=tools) == want
    # thinking mode with tools keeps every assistant turn's reasoning (the official encoding's rule)
    msgs[2]["reasoning_content"] = "look it up"
    assert "<｜Assistant｜><think>look it up</think>\n\n<" in model.apply_chat_template(msgs, tools=tools,
                                                                                         thinking=True)
    for bad in ("abc", "[1]"):
        with pytest.raises(Ds4cError) as e:
            model.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": [
                {"function": {"name": "f", "arguments": bad}}]}])
        one_line(e, "arguments: expected a JSON object")
    with pytest.raises(Ds4cError) as e:
        model.apply_chat_template(msgs, tools="get_weather")
    one_line(e, "tools: expected a list")


# ------------------------------------------------------------------------------------------------ engine

def test_engine_choice(tiny_path):
    assert resolve_engine("cpu") == "reference" and resolve_engine("cpu", "reference") == "reference"
    mf = open_model(tiny_path)
    with pytest.raises(Ds4cError) as e:
        open_engine(mf, "cpu", "compiled")
    one_line(e, "compiled engine", "runs on device 'cuda' only, found device 'cpu'")
    with pytest.raises(Ds4cError) as e:
        open_engine(mf, "cpu", artifact="/does/not/exist")
    one_line(e, "--artifact is used only by the compiled engine")
    with pytest.raises(Ds4cError) as e:
        open_engine(mf, "tpu")
    one_line(e, "unknown device 'tpu'")
    with pytest.raises(Ds4cError) as e:
        open_engine(mf, "cpu", "fast")
    one_line(e, "unknown engine 'fast'")
    with pytest.raises(Ds4cError) as e:
        open_engine(mf, "cpu", max_ctx=70000)
    one_line(e, "max_ctx", "65536")
    with pytest.raises(Ds4cError) as e:
        open_engine(mf, "cpu", threads=0)
    one_line(e, "threads")
    cpus = len(os.sched_getaffinity(0))
    with pytest.raises(Ds4cError) as e:  # OpenMP segfaulted at 100000
        open_engine(mf, "cpu", threads=100000)
    one_line(e, "threads", f"1..{cpus}", "100000")
    if not torch.cuda.is_available():
        with pytest.raises(Ds4cError) as e:
            Model(tiny_path, device="cuda")
        one_line(e, "device 'cuda'", "no CUDA device")
    n = torch.get_num_threads()
    try:
        ref = open_engine(mf, "cpu", threads=2, max_ctx=32, quant_emulation=False)
        assert torch.get_num_threads() == 2
        assert isinstance(ref, Reference) and ref.max_ctx == 32 and not ref.w.config.quant_emulation
    finally:
        torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------ CLI

def run(home: Path, *args: str) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], env={"DS4C_HOME": str(home)}, catch_exceptions=False)


def assert_error_line(r: Result, *parts: str) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ds4c: error: "), r.stderr
    for p in parts:
        assert p in lines[0], lines[0]
    return lines[0]


def test_cli_prompt_streams_text(tmp_path, tiny_path, model):
    want = model.generate(PROMPT, max_new_tokens=8)
    r = run(tmp_path, "generate", tiny_path, "--prompt", PROMPT, "--max-new-tokens", "8")
    assert r.exit_code == 0, r.output
    assert r.stdout == want.text + "\n"
    assert re.search(r"^load [\d.]+ s, prefill \d+ tokens in [\d.]+ s, decode [\d.]+ tokens/s \(prefill [\d.]+ "
                     r"tokens/s; 8 new tokens, stop: length\)$", r.stderr, re.M), r.stderr
    f = tmp_path / "prompt.txt"
    f.write_text(PROMPT, encoding="utf-8")
    r2 = run(tmp_path, "generate", tiny_path, "--prompt-file", f, "--max-new-tokens", "8")
    assert r2.exit_code == 0 and r2.stdout == r.stdout


def test_cli_json_has_text(tmp_path, tiny_path, model):
    want = model.generate(PROMPT, max_new_tokens=6, temperature=0.7, top_k=50, top_p=0.9, seed=3)
    r = run(tmp_path, "generate", tiny_path, "--prompt", PROMPT, "--max-new-tokens", "6", "--temperature", "0.7",
            "--top-k", "50", "--top-p", "0.9", "--seed", "3", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert rec["text"] == want.text and rec["tokens"] == want.ids and rec["prompt"] == want.prompt_ids
    assert rec["stop_reason"] == want.stop_reason and rec["top_k"] == 50 and rec["top_p"] == 0.9
    assert rec["engine"] == "reference" and rec["load_s"] > 0
    # --prompt-ids: ids printed, the text too; the json record has it
    rec2 = json.loads(run(tmp_path, "generate", tiny_path, "--prompt-ids", ",".join(map(str, want.prompt_ids)),
                          "--max-new-tokens", "6", "--temperature", "0.7", "--top-k", "50", "--top-p", "0.9",
                          "--seed", "3", "--json").stdout)
    assert rec2["tokens"] == want.ids and rec2["text"] == want.text


def test_cli_stop_eos_and_ignore_eos(tmp_path, tiny_path, model, eos_case):
    full = model.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    stop = _ascii_stop(full.text)
    r = run(tmp_path, "generate", tiny_path, "--prompt", PROMPT, "--max-new-tokens", "24", "--stop", "zzzz",
            "--stop", stop)
    assert r.exit_code == 0, r.output
    assert r.stdout == full.text[:full.text.find(stop)] + "\n" and "stop: stop" in r.stderr
    args = ("generate", tiny_path, "--prompt", EOS_PROMPT, "--max-new-tokens", str(EOS_MAX), "--temperature",
            str(EOS_TEMP), "--seed", str(eos_case[0]), "--json")
    rec = json.loads(run(tmp_path, *args).stdout)
    assert rec["stop_reason"] == "eos" and len(rec["tokens"]) == eos_case[1] and rec["tokens"][-1] == 1
    rec = json.loads(run(tmp_path, *args, "--ignore-eos").stdout)
    assert rec["stop_reason"] == "length" and len(rec["tokens"]) == EOS_MAX
    r = run(tmp_path, "generate", tiny_path, "--prompt", PROMPT, "--max-new-tokens", "3", "--threads", "1")
    assert r.exit_code == 0 and "stop: length" in r.stderr


def test_cli_default_prompt_is_text_and_ids_on_a_bare_file(tmp_path, tiny_path, bare_path):
    r = run(tmp_path, "generate", tiny_path, "--max-new-tokens", "3", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert rec["prompt"] == Model(tiny_path, max_ctx=16).tokenize(PROMPT) and isinstance(rec["text"], str)
    rb = run(tmp_path, "generate", bare_path, "--max-new-tokens", "3", "--json")
    assert rb.exit_code == 0, rb.output
    recb = json.loads(rb.stdout)
    assert recb["prompt"] == [0, 1, 2, 3] and recb["text"] is None
    rt = run(tmp_path, "generate", bare_path, "--prompt-ids", "4,5", "--max-new-tokens", "2")
    assert rt.exit_code == 0 and "tokens: [" in rt.stdout and "text:" not in rt.stdout
    assert_error_line(run(tmp_path, "generate", bare_path, "--prompt", "hi"), str(bare_path), "no tokenizer",
                      "--prompt-ids")


def test_cli_bad_inputs(tmp_path, tiny_path):
    f = tmp_path / "p.txt"
    f.write_text("x")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "a", "--prompt-ids", "1"),
                      "give one of --prompt, --prompt-file, --prompt-ids", "--prompt and --prompt-ids")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "a", "--prompt-file", f),
                      "--prompt and --prompt-file")
    for v in ("0", "1.5", "-0.1", "nan"):
        assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "a", "--top-p", v), "--top-p", "(0, 1]")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "a", "--top-k", "-1"), "--top-k", ">= 0")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt-file", tmp_path / "missing.txt"),
                      "--prompt-file", "missing.txt", "no such file")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt-file", tmp_path), "--prompt-file", "directory")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe bad")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt-file", bad), "not UTF-8")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "a", "--threads", "0"), "--threads")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "a", "--threads", "100000"), "--threads",
                      "100000")
    # invalid UTF-8 bytes on the command line reach Python as lone surrogates (surrogateescape)
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "ab\udcffc", "--max-new-tokens", "1"),
                      "not valid Unicode", "character 2")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "a", "--stop", ""), "--stop")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--prompt", "a", "--max-new-tokens", "70000"),
                      "--max-new-tokens 70000", "context length 65536")
    assert not (tmp_path / "models").exists()  # an explicit file never creates the default model


def test_cli_chat_renders_the_template(tmp_path, tiny_path, model):
    """--chat/--system/--think/--reasoning-effort go through the file's chat template: the prompt ids are the
    rendered conversation, and the reply equals Model.chat's."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = model.chat(msgs, max_new_tokens=6, thinking=True, reasoning_effort="max")
    r = run(tmp_path, "generate", tiny_path, "--chat", "Hi there", "--system", "Be brief.", "--think",
            "--reasoning-effort", "max", "--max-new-tokens", "6", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    rendered = model.detokenize(rec["prompt"])
    assert rendered == model.apply_chat_template(msgs, thinking=True, reasoning_effort="max")
    assert "<｜User｜>Hi there" in rendered and "Be brief." in rendered and "Reasoning Effort: max" in rendered
    assert rendered.endswith("<｜Assistant｜><think>")
    assert rec["tokens"] == want.ids and rec["text"] == want.text
    no_think = json.loads(run(tmp_path, "generate", tiny_path, "--chat", "Hi there", "--no-think",
                              "--max-new-tokens", "1", "--json").stdout)
    assert model.detokenize(no_think["prompt"]).endswith("<｜Assistant｜></think>")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--chat", "Hi", "--prompt", "x"), "give one of")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--system", "x"), "go with --chat")


def test_reasoning_effort_is_checked_against_the_template(tiny_path):
    """A reasoning effort the chat template does not know (it compares with 'high' / 'max') is a one-line error
    naming the known values, not silently ignored."""
    from ds4c.api import Model
    from ds4c.errors import Ds4cError

    model = Model(tiny_path, max_ctx=64)
    msgs = [{"role": "user", "content": "hi"}]
    assert "Reasoning Effort: max." in model.apply_chat_template(msgs, thinking=True, reasoning_effort="max")
    with pytest.raises(Ds4cError, match=r"expected one of the values the chat template knows \(high, max\), "
                                        r"found 'hihg'") as e:
        model.apply_chat_template(msgs, thinking=True, reasoning_effort="hihg")
    assert "\n" not in str(e.value)


def test_chat_rules_refuse_what_the_template_would_drop(model, tmp_path, tiny_path):
    """Issue 28.6: a reasoning effort without thinking (DeepSeek-V4's template then ignores it) and a tool result,
    call or tool that the template would drop are one-line errors, in the API and in ds4c generate (before the engine
    starts), not a prompt that silently lacks them."""
    msgs = [{"role": "user", "content": "hi"}]
    for thinking in (None, False):
        with pytest.raises(Ds4cError) as e:
            model.apply_chat_template(msgs, thinking=thinking, reasoning_effort="high")
        one_line(e, "reasoning_effort 'high' would change nothing in the prompt", "thinking=True", "--think")
    assert "Reasoning Effort: high." in model.apply_chat_template(msgs, thinking=True, reasoning_effort="high")
    # a tool result, a tool call and an offered tool must show in the prompt: DeepSeek-V4's template renders them,
    # a template that knows only user and assistant turns would drop them
    tool = [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny, 21 C"}]
    assert "<tool_result>sunny, 21 C</tool_result>" in model.apply_chat_template(tool)
    call = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    m2 = Model(tiny_path, max_ctx=16)
    m2.tokenizer._chat_template = ("{% for m in messages %}{% if m.role in ['user', 'assistant'] %}"
                                   "{{ m.role }}: {{ m.content or '' }}\n{% endif %}{% endfor %}")
    for msgs2, kw, where in ((tool, {}, "messages[1] (a tool result)"), (call, {}, "messages[1].tool_calls[0]"),
                             (msgs, {"tools": tools}, "tools[0]")):
        with pytest.raises(Ds4cError) as e:
            m2.chat(msgs2, max_new_tokens=1, **kw)
        one_line(e, where, "the chat template does not render it", "does not support tool calls")
    with pytest.raises(Ds4cError) as e:
        model.apply_chat_template([{"role": "usr", "content": "hi"}])
    one_line(e, "messages[0]", "expected role 'system', 'user', 'assistant', 'tool'", "found 'usr'")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--chat", "Hi", "--reasoning-effort", "high"),
                      "reasoning_effort 'high' would change nothing", "--think")
    assert_error_line(run(tmp_path, "generate", tiny_path, "--chat", "Hi", "--no-think", "--reasoning-effort", "max"),
                      "reasoning_effort 'max' would change nothing", "--think")


def test_generate_with_a_drafter_reports_it_on_the_completion(model, tmp_path):
    """Model.generate(draft=...) takes a drafter spelling, a path to a drafter file (os.PathLike) or a drafter
    object; the completion carries the speculative report (``speculative``, also in ``as_dict``), and greedy
    speculative output equals plain greedy output."""
    from ds4c.drafters.dspark_synth import make_dspark
    from ds4c.drafters.oracle import OracleDrafter

    ids = [5, 17, 301, 42]
    plain = model.generate(ids, max_new_tokens=8, ignore_eos=True)
    assert plain.speculative is None and "speculative" not in plain.as_dict()
    path = make_dspark(model.file, tmp_path / "d.gguf", seed=1)
    for draft in ("oracle:0.7", path, OracleDrafter(0.5, model.vocab_size)):
        c = model.generate(ids, max_new_tokens=8, ignore_eos=True, draft=draft, spec_width=3)
        assert c.ids == plain.ids and c.speculative["steps"] > 0 and c.as_dict()["speculative"] == c.speculative
    with pytest.raises(Ds4cError, match="draft: expected a drafter spelling"):
        model.generate(ids, max_new_tokens=4, draft=0.7)


# ------------------------------------------------------------------------------------------------ Ctrl-C (issue 28.5)

def _ctrl_c_at_decode(monkeypatch, n: int) -> None:
    """Ctrl-C during the ``n``-th decode step of the reference (after ``n`` new tokens)."""
    real, calls = Reference.decode, [0]

    def decode(self, *a, **k):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(Reference, "decode", decode)


def test_api_ctrl_c_keeps_what_was_made(tiny_path, monkeypatch):
    from ds4c.errors import GenerationInterrupted

    m = Model(tiny_path, max_ctx=64)
    want = m.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    _ctrl_c_at_decode(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt) as ei:
        m.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    assert isinstance(ei.value, GenerationInterrupted)
    c = ei.value.completion
    assert c.stop_reason == c.result.stop_reason == "interrupted" and c.ids == want.ids[:3]
    assert want.text.startswith(c.text)
    monkeypatch.undo()
    assert m.generate(PROMPT, max_new_tokens=8, ignore_eos=True).ids == want.ids  # the Model's turn was released


@pytest.mark.parametrize("mode", ["text", "json", "ids"])
def test_cli_ctrl_c_ends_with_the_tokens_so_far_and_exit_130(tmp_path, tiny_path, model, monkeypatch, mode):
    want = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    _ctrl_c_at_decode(monkeypatch, 3)
    args = ["generate", tiny_path, "--max-new-tokens", "8", "--ignore-eos"]
    args += ["--prompt-ids", ",".join(map(str, want.prompt_ids))] if mode == "ids" else ["--prompt", PROMPT]
    r = run(tmp_path, *args, *(["--json"] if mode == "json" else []))
    assert r.exit_code == 130, (r.exit_code, r.output)
    assert "Aborted" not in r.output
    if mode == "json":
        rec = json.loads(r.stdout)
        assert rec["stop_reason"] == "interrupted" and rec["tokens"] == want.ids[:3], rec
        return
    assert re.search(r"[(; ]3 new tokens, stop: interrupted\)$", r.stderr, re.M), r.stderr
    if mode == "ids":
        assert f"tokens: {want.ids[:3]}" in r.stdout
    else:
        assert want.text.startswith(r.stdout.rstrip("\n")) and r.stdout.strip(), r.stdout
