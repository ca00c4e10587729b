"""``ds4c serve``'s handlers and scheduler with a scripted engine (tests/test_server.py runs the real one): the app of
ds4c/server/app.py on uvicorn in a thread on 127.0.0.1, the tiny model's tokenizer and V4 chat template, an engine
that answers each request with a scripted text. Tool calls (auto, none, required, named; thinking mode's two-part
reply), JSON fallbacks, reasoning switches, queue limits, timeouts, disconnects and drain, through the official
openai client and httpx; and the one-sequence engine's bounded buffer with a consumer that stops reading."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from ds4c.api import Model
from ds4c.server import app as app_module
from ds4c.server.app import ServerOptions, create_app
from ds4c.server.engine import EngineStats, Finished, GenRequest, Piece, RequestStream, SerialEngine, SamplingParams
from ds4c.server.metrics import Metrics
from ds4c.server.scheduler import Scheduler, SchedulerConfig

D = "｜DSML｜"
NAME = "tiny-test"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
CALL = (f"<{D}invoke name=\"get_weather\">\n<{D}parameter name=\"city\" string=\"true\">Oslo</{D}parameter>\n"
        f"<{D}parameter name=\"days\" string=\"false\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")


class ScriptedEngine:
    """An :class:`~ds4c.server.engine.Engine` whose replies are scripted texts (taken in order), sent ``piece``
    characters a piece with ``delay`` seconds between pieces; stop strings and ``max_tokens`` (one piece = one
    token) cut them as the real engine does. ``requests`` records what it was asked; ``pushed`` the pieces each
    request got."""

    def __init__(self, max_ctx: int = 4096, capacity: int = 1):
        self.max_ctx, self.capacity = max_ctx, capacity
        self.replies: list[str] = []
        self.delay = 0.0
        self.piece = 3
        self.requests: list[GenRequest] = []
        self.pushed: list[int] = []
        self._running = 0

    def start(self, req: GenRequest, stream: RequestStream) -> None:
        self.requests.append(req)
        text = self.replies.pop(0) if self.replies else "ok"   # a list: its pieces as they are
        self.pushed.append(0)
        threading.Thread(target=self._run, args=(req, stream, text, len(self.pushed) - 1), daemon=True).start()

    def _run(self, req: GenRequest, stream: RequestStream, text: str, k: int) -> None:
        self._running += 1
        try:
            p = req.params
            hits = [(text.find(s), s) for s in p.stop if s in text] if isinstance(text, str) else []
            cut, matched = min(hits) if hits else (len(text), None)
            n = self.piece
            pieces = list(text) if isinstance(text, list) else [text[i:min(i + n, cut)] for i in range(0, cut, n)]
            reason = "stop" if matched else "eos"
            if len(pieces) > p.max_tokens:
                pieces, reason, matched = pieces[:p.max_tokens], "length", None
            for n, piece in enumerate(pieces, 1):
                if stream.cancelled:
                    stream.push(Finished("cancelled", len(req.prompt_ids), n - 1))
                    return
                time.sleep(self.delay)
                stream.push(Piece(piece, n))
                self.pushed[k] = n
            stream.push(Finished(reason, len(req.prompt_ids), len(pieces) + (matched is not None), matched))
        finally:
            self._running -= 1

    def stats(self) -> EngineStats:
        return EngineStats(self._running, 0)

    def close(self) -> None:
        pass


class Served:
    """The app on uvicorn in a thread; ``url``, ``engine``, ``app``; ``client()`` an openai client."""

    def __init__(self, model: Model, engine, config: SchedulerConfig = SchedulerConfig(), **kw):
        self.engine = engine
        self.app = create_app(model, engine, ServerOptions(model_name=NAME, scheduler=config, **kw))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 30, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def model(tiny_path) -> Model:
    return Model(tiny_path, max_ctx=4096)


@pytest.fixture(scope="module")
def served(model):
    s = Served(model, ScriptedEngine())
    yield s
    s.stop()


@pytest.fixture
def engine(served) -> ScriptedEngine:
    e = served.engine
    e.replies, e.delay, e.piece, e.requests, e.pushed = [], 0.0, 3, [], []
    return e


def _prompt(model: Model, messages, **kw) -> list[int]:
    return model.prompt_ids(model.apply_chat_template(messages, **kw))


MSGS = [{"role": "user", "content": "Weather in Oslo?"}]


# ------------------------------------------------------------------------------------------------ tool calls
def test_tool_calls_auto(served, engine, model):
    """Offered tools are rendered into the prompt (the V4 template); the reply's DSML block comes back as OpenAI
    tool_calls, whole and streamed, with the content before it and finish_reason tool_calls."""
    reply = "Let me look.\n\n" + f"<{D}tool_calls>\n" + CALL
    engine.replies = [reply, reply]
    c = served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, temperature=0)
    assert engine.requests[0].prompt_ids == tuple(_prompt(model, MSGS, tools=TOOLS))
    ch = c.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me look."
    (tc,) = ch.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Oslo", "days": 2}
    assert c.usage.prompt_tokens == len(engine.requests[0].prompt_ids)

    s = served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, temperature=0, stream=True)
    content, calls, finish = "", {}, None
    for chunk in s:
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            cur = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
            cur["arguments"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me look." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather",
                                                                                  {"city": "Oslo", "days": 2})]
    # the tool result goes back into the conversation as the template renders it
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": tc.id, "type": "function", "function": {"name": "get_weather", "arguments": tc.function.arguments}}]},
        {"role": "tool", "tool_call_id": tc.id, "content": "sunny, 21 C"}]
    engine.replies = ["It is sunny."]
    c2 = served.client().chat.completions.create(model=NAME, messages=history, tools=TOOLS)
    assert c2.choices[0].message.content == "It is sunny." and c2.choices[0].finish_reason == "stop"
    want = model.apply_chat_template(history, tools=TOOLS)
    assert "<tool_result>sunny, 21 C</tool_result>" in want
    assert engine.requests[-1].prompt_ids == tuple(model.prompt_ids(want))


def test_tool_choice_none_required_named_and_fallbacks(served, engine, model):
    # none: the tools are not offered; DSML in the reply stays text
    engine.replies = [f"<{D}tool_calls>\n" + CALL]
    c = served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="none")
    assert engine.requests[-1].prompt_ids == tuple(_prompt(model, MSGS))
    assert c.choices[0].message.tool_calls is None and D in c.choices[0].message.content
    # required: the prompt goes on with the block's start, the reply is parsed from there
    engine.replies = [CALL]
    c = served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required")
    forced = model.apply_chat_template(MSGS, tools=TOOLS) + f"\n\n<{D}tool_calls>\n"
    assert engine.requests[-1].prompt_ids == tuple(model.prompt_ids(forced))
    assert [t.function.name for t in c.choices[0].message.tool_calls] == ["get_weather"]
    # a named function: the invoke is opened too
    engine.replies = [f"</{D}invoke>\n</{D}tool_calls>"]
    c = served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS,
                                                tool_choice={"type": "function", "function": {"name": "now"}})
    assert model.detokenize(engine.requests[-1].prompt_ids).endswith(f"<{D}invoke name=\"now\">\n")
    (tc,) = c.choices[0].message.tool_calls
    assert (tc.function.name, tc.function.arguments, c.choices[0].finish_reason) == ("now", "{}", "tool_calls")
    # required, and the model writes no call: its own text is the content, without the opening the server wrote
    engine.replies = ["no tool fits", "no tool fits"]
    c = served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required")
    assert (c.choices[0].message.content, c.choices[0].message.tool_calls) == ("no tool fits", None)
    s = served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required",
                                                stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s) == "no tool fits"
    # the seed's JSON fallbacks, for offered tools only
    engine.replies = ['{"function": "now", "parameters": {"tz": "UTC"}}',
                      '{"function_call": {"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}}',
                      '{"function": "rm", "parameters": {}}']
    got = [served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS).choices[0].message
           for _ in range(3)]
    assert [(t.function.name, json.loads(t.function.arguments)) for m in got[:2] for t in m.tool_calls] == \
        [("now", {"tz": "UTC"}), ("get_weather", {"city": "Rome"})]
    assert got[2].tool_calls is None and got[2].content == '{"function": "rm", "parameters": {}}'


def test_required_in_thinking_mode_continues_after_the_reasoning(served, engine, model):
    """tool_choice required with thinking on: the reasoning is generated first (stopping at </think>), then the
    prompt goes on with the reasoning, </think> and the block's start; reasoning_content and the call come back,
    the usage adds both parts."""
    engine.replies = ["I need the weather.</think>never sent", CALL]
    c = served.client().chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required",
                                                reasoning_effort="high", max_tokens=200)
    first, second = engine.requests[-2:]
    head = model.apply_chat_template(MSGS, tools=TOOLS, thinking=True, reasoning_effort="high")
    assert first.prompt_ids == tuple(model.prompt_ids(head)) and "</think>" in first.params.stop
    assert second.prompt_ids == tuple(model.prompt_ids(head + "I need the weather.</think>\n\n"
                                                       f"<{D}tool_calls>\n"))
    n_first = -(-len("I need the weather.") // 3) + 1     # its pieces and the </think> that stopped it
    assert second.params.max_tokens == 200 - n_first        # the second part gets what the first left
    msg = c.choices[0].message
    assert msg.reasoning_content == "I need the weather." and c.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == \
        [("get_weather", {"city": "Oslo", "days": 2})]
    assert c.usage.prompt_tokens == len(first.prompt_ids)
    assert c.usage.completion_tokens == n_first + -(-len(CALL) // 3)


# ------------------------------------------------------------------------------------------------ reasoning
@pytest.mark.parametrize("extra,thinking,effort", [
    ({"reasoning_effort": "low"}, True, None), ({"reasoning_effort": "medium"}, True, "high"),
    ({"reasoning_effort": "xhigh"}, True, "high"), ({"reasoning": {"effort": "max"}}, True, "max"),
    ({"chat_template_kwargs": {"thinking": True, "reasoning_effort": "high"}}, True, "high"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, True, None),
    ({"reasoning_effort": "max", "chat_template_kwargs": {"thinking": False}}, False, None),
    ({"reasoning_effort": "none"}, False, None), ({}, None, None)])
def test_reasoning_switches(served, engine, model, extra, thinking, effort):
    engine.replies = ["weighing it</think>Answer."]
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": NAME, "messages": MSGS, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_ids == tuple(_prompt(model, MSGS, thinking=thinking, reasoning_effort=effort))
    msg = r.json()["choices"][0]["message"]
    if thinking:
        assert (msg["reasoning_content"], msg["content"]) == ("weighing it", "Answer.")
    else:
        assert "reasoning_content" not in msg and msg["content"] == "weighing it</think>Answer."


def test_a_developer_message_is_the_system_prompt(served, engine, model):
    """OpenAI's newer clients send the system prompt with role "developer": rendered as V4's system message."""
    engine.replies = ["Fine."]
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "developer", "content": "Be brief."}] + MSGS})
    assert r.status_code == 200, r.text
    want = _prompt(model, [{"role": "system", "content": "Be brief."}] + MSGS)
    assert engine.requests[-1].prompt_ids == tuple(want) and want != _prompt(model, MSGS)


def test_empty_pieces_make_no_chunks(served, engine):
    """The engine sends an empty piece while a token's text is held (a partial UTF-8 character, a possible stop
    string): no empty chunk reaches the client."""
    engine.replies = [["", "Hel", "", "lo"]]
    s = served.client().completions.create(model=NAME, prompt="hi", stream=True)
    assert [c.choices[0].text for c in s] == ["Hel", "lo", ""]     # the last: finish_reason's chunk


def test_a_body_that_never_arrives_is_a_408(served, monkeypatch):
    """A client that announces a longer body than it sends gets 408 after BODY_TIMEOUT_S, not a handler held
    forever."""
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0.5)
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\"")
        got = b""
        while b"}}" not in got:
            more = c.recv(65536)
            assert more, got
            got += more
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "body_timeout"


def test_reasoning_streams_apart_from_content(served, engine):
    engine.replies = ["step one, step two</think>Done."]
    s = served.client().chat.completions.create(model=NAME, messages=MSGS, stream=True, reasoning_effort="high")
    reasoning = content = ""
    for chunk in s:
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
    assert (reasoning, content) == ("step one, step two", "Done.")


# ------------------------------------------------------------------------------------------------ scheduling
def test_queue_full_queue_timeout_and_request_timeout(model):
    """One slot, one queue place: a third request is refused at once (429 queue_full), a queued one that waits too
    long gets 429 queue_timeout, a request past its time limit gets 408 (an error event when streaming); each
    counted in /metrics."""
    eng = ScriptedEngine()
    s = Served(model, eng, SchedulerConfig(max_queue=1, queue_timeout_s=1.0, request_timeout_s=2.5))
    try:
        eng.delay, eng.replies = 0.1, ["x" * 60] * 4    # 20 pieces: 2 s each
        body = {"model": NAME, "prompt": "hi", "max_tokens": 100}

        async def three():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                a = asyncio.create_task(c.post("/v1/completions", json=body))
                await asyncio.sleep(0.3)
                b = asyncio.create_task(c.post("/v1/completions", json=body))
                await asyncio.sleep(0.3)
                third = await c.post("/v1/completions", json=body)
                return await a, await b, third

        a, b, third = asyncio.run(three())
        assert a.status_code == 200 and a.json()["choices"][0]["text"] == "x" * 60
        assert b.status_code == 429 and b.json()["error"]["code"] == "queue_timeout" and "retry-after" in b.headers
        assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        eng.delay = 0.2                                  # 20 pieces: 4 s > the 2.5 s limit
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error"
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout" and lines[-1] == "data: [DONE]"
        assert eng.pushed[-1] < 20 and eng.pushed[-2] < 20   # the engine was told to stop
        m = httpx.get(s.url + "/metrics").text
        assert 'ds4c_requests_total{endpoint="completions",outcome="rejected"} 2.0' in m
        assert 'ds4c_requests_total{endpoint="completions",outcome="timeout"} 2.0' in m
    finally:
        s.stop()


def test_disconnect_cancels_and_drain_refuses(model):
    """A client that goes away (streaming or not) has its generation stopped and its slot freed: the next request
    runs at once. After drain(), new requests get 503 and /health says draining."""
    eng = ScriptedEngine()
    s = Served(model, eng)
    try:
        eng.delay, eng.replies = 0.05, ["y" * 300] * 2   # 100 pieces: 5 s each
        body = {"model": NAME, "prompt": "hi", "max_tokens": 200}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json=body, timeout=0.5)
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            next(r.iter_lines())                          # the first chunk, then hang up
        eng.delay, eng.replies = 0.0, ["fine"]
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.json()["choices"][0]["text"] == "fine" and time.monotonic() - t0 < 3
        assert max(eng.pushed[:2]) < 100
        m = httpx.get(s.url + "/metrics").text
        assert 'ds4c_requests_total{endpoint="completions",outcome="cancelled"} 2.0' in m
        assert "ds4c_running_sequences 0.0" in m and "ds4c_queue_depth 0.0" in m
        s.app.state.scheduler.drain()
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert httpx.get(s.url + "/health").status_code == 503
    finally:
        s.stop()


def test_clients_that_leave_before_their_reply_begins_are_gone_at_once(model):
    """A client that gives up while its request is queued leaves the queue at once (the next one is not refused as
    queue_full, the engine never starts it); one that closes while sending its body is counted cancelled, with no
    traceback; completions' max_tokens null is OpenAI's 16."""
    eng = ScriptedEngine()
    s = Served(model, eng, SchedulerConfig(max_queue=1))
    try:
        eng.delay, eng.replies = 0.05, ["y" * 150]        # 50 pieces: 2.5 s holding the one slot
        body = {"model": NAME, "prompt": "hi", "max_tokens": 200}
        hold = threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", json=body, timeout=30))
        hold.start()
        t0 = time.monotonic()
        while "ds4c_running_sequences 1.0" not in httpx.get(s.url + "/metrics").text:
            assert time.monotonic() - t0 < 10
            time.sleep(0.02)
        with pytest.raises(httpx.ReadTimeout):           # queued, then the client gives up
            httpx.post(s.url + "/v1/completions", json=body, timeout=0.3)
        time.sleep(0.2)
        assert "ds4c_queue_depth 0.0" in httpx.get(s.url + "/metrics").text
        eng.replies = ["fine"]
        r = httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": None}, timeout=30)  # waits its turn
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fine"
        assert eng.requests[-1].params.max_tokens == 16 and len(eng.requests) == 2   # the gone one never ran
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\"")
        time.sleep(0.3)
        m = httpx.get(s.url + "/metrics").text
        assert 'ds4c_requests_total{endpoint="completions",outcome="cancelled"} 2.0' in m
        assert 'outcome="failed"' not in m and 'outcome="invalid"' not in m
        hold.join(30)
    finally:
        s.stop()


def test_a_client_that_stops_reading_does_not_slow_the_others(model):
    """A streaming client that stops reading (a raw socket with a small receive buffer that never reads): once the
    socket buffers are full its handler blocks, its bounded buffer fills and its generation is cancelled, so the
    engine stops for it and the next client's request runs at once."""
    eng = ScriptedEngine()
    s = Served(model, eng, SchedulerConfig(stream_buffer=8))
    slow = socket.socket()
    try:
        eng.piece, eng.delay = 1 << 16, 0.002
        eng.replies = ["z" * (eng.piece * 400), "fine"]     # 400 pieces of 64 KiB: 26 MB, more than any buffer
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", int(s.url.rsplit(":", 1)[1])))
        body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 1000, "stream": True}).encode()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        t0 = time.monotonic()
        while not eng.pushed or s.app.state.scheduler.engine.stats().running:
            assert time.monotonic() - t0 < 30, "the slow client's generation was never stopped"
            time.sleep(0.01)
        assert 0 < eng.pushed[0] < 400                       # stopped early: the engine did not wait for it
        t1 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "hi"}, timeout=30)
        assert r.json()["choices"][0]["text"] == "fine" and time.monotonic() - t1 < 3
    finally:
        slow.close()
        s.stop()


def test_a_consumer_that_stops_reading_is_cut_off_not_waited_for(model):
    """The one-sequence engine on the real model: a request whose consumer stops taking pieces (a handler blocked
    on a client that stopped reading) fills its bounded buffer and is cancelled; the engine never waits for it, so
    the request queued behind it starts as soon as that happens and gives the same tokens as alone."""
    eng = SerialEngine(model)
    sched = Scheduler(eng, Metrics(), SchedulerConfig(stream_buffer=4))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = tuple(model.prompt_ids("The quick brown fox"))
    alone = model.generate(list(ids), max_new_tokens=12, ignore_eos=True)

    async def scenario():
        async with sched.slot(time.monotonic()) as slow:
            st_slow = await slow.start(GenRequest("slow", ids, dataclasses.replace(greedy, max_tokens=400)))

            async def other():
                async with sched.slot(time.monotonic()) as s2:
                    st = await s2.start(GenRequest("other", ids, greedy))
                    text = [ev.text async for ev in s2.events(st) if isinstance(ev, Piece)]
                    return "".join(text), st.terminal

            task = asyncio.create_task(other())
            await asyncio.wait_for(st_slow.done.wait(), 120)  # never read: it overflows and stops
            assert st_slow.overflowed and st_slow.terminal.reason == "cancelled"
            assert st_slow.terminal.completion_tokens < 20
            return await asyncio.wait_for(task, 120)

    try:
        text, fin = asyncio.run(scenario())
        assert text == alone.text and fin.completion_tokens == 12 and fin.reason == "length"
    finally:
        eng.close()



def test_an_engine_outliving_the_server_loop_keeps_working(model):
    """The engine pushes a request's events after the server's event loop has closed (the server stopped while a
    generation ran): the events are dropped, the engine thread lives on and runs the next request."""
    eng = SerialEngine(model)
    loop = asyncio.new_event_loop()
    try:
        gone = RequestStream(loop, 64)
        loop.close()
        gone.push(Piece("x", 1))             # no RuntimeError: the loop is gone, the event with it
        ids = tuple(model.prompt_ids("Hi"))
        eng.start(GenRequest("orphan", ids, SamplingParams(max_tokens=2, ignore_eos=True)), gone)

        async def next_request():
            st = RequestStream(asyncio.get_running_loop(), 64)
            eng.start(GenRequest("next", ids, SamplingParams(max_tokens=2, ignore_eos=True)), st)
            await asyncio.wait_for(st.done.wait(), 60)
            return st.terminal

        fin = asyncio.run(next_request())
        assert isinstance(fin, Finished) and (fin.reason, fin.completion_tokens) == ("length", 2)
    finally:
        eng.close()
