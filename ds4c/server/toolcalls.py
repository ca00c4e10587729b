"""The model's reply text -> OpenAI's ``reasoning_content``, ``content`` and ``tool_calls``, incrementally.

DeepSeek-V4 writes (facts from its official encoding and llama.cpp's ``common/parsers/deepseek.cpp``):

* in thinking mode the reply starts inside ``<think>`` (the generation prompt opened it): the reasoning runs to
  ``</think>``; a tool-call block also ends it;
* tool calls as DSML, after the content, separated from it by ``"\\n\\n"``::

      <｜DSML｜tool_calls>
      <｜DSML｜invoke name="get_weather">
      <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
      <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  ``string="true"``: the value is the text as is; ``"false"``: JSON.

The seed's fallbacks for checkpoints that answer in JSON are accepted too, when the whole content is one JSON
object naming an offered tool: ``{"function": NAME, "parameters": {...}}`` and the legacy
``{"function_call": {"name": NAME, "arguments": {...} or its JSON text}}``; other JSON stays content.

:class:`OutputParser` takes the text as it is generated (:meth:`~OutputParser.feed`, any split, one character at a
time included) and returns deltas as soon as they are certain: text that may be the start of a marker is held
until the next piece decides it; content that may be a JSON fallback (it starts with ``{``) is held to the end.
Tool calls stream as OpenAI's do: the name (and id) when an ``invoke`` opens, then the arguments' JSON in pieces
as each parameter closes, their concatenation one JSON object.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ds4c.markers import held_back

DSML = "｜DSML｜"
THINK_END = "</think>"
CALLS_START = f"<{DSML}tool_calls>"
CALLS_END = f"</{DSML}tool_calls>"
INVOKE_START = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAM_START = f"<{DSML}parameter"
PARAM_END = f"</{DSML}parameter>"
CALLS_SEPARATOR = "\n\n"

_INVOKE_OPEN = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>')
_PARAM_OPEN = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>')

__all__ = ["OutputParser", "ReasoningDelta", "ContentDelta", "ToolCallDelta", "ToolCall", "new_call_id",
           "json_fallback_call", "CALLS_START", "THINK_END", "DSML"]


@dataclass(frozen=True)
class ReasoningDelta:
    """More reasoning text (OpenAI's ``delta.reasoning_content``)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """More answer text (``delta.content``)."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of tool call ``index`` (``delta.tool_calls[0]``): ``id`` and ``name`` on its first piece only,
    ``arguments`` a piece of the arguments' JSON text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    """A whole tool call: its id, the function's name and the arguments as JSON text (an object)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Delta = ReasoningDelta | ContentDelta | ToolCallDelta


def new_call_id() -> str:
    """A fresh tool-call id (``call_`` and 24 hex digits, the shape of OpenAI's)."""
    return "call_" + secrets.token_hex(12)


def _earliest(text: str, markers: Collection[str]) -> tuple[int, str] | None:
    """(position, marker) of the marker found first in ``text`` (the longest at a tie), or None."""
    hits = [(i, -len(m), m) for m in markers if (i := text.find(m)) >= 0]
    if not hits:
        return None
    i, _, m = min(hits)
    return i, m


def json_fallback_call(text: str, tools: Collection[str]) -> tuple[str, str] | None:
    """(name, arguments JSON text) when ``text`` is one JSON object in a fallback shape naming one of ``tools``:
    ``{"function": NAME, "parameters": {...}}`` or ``{"function_call": {"name": NAME, "arguments": {...} or its
    JSON text}}``; None otherwise (it stays content)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), str) and set(obj) <= {"function", "parameters"}:
        name, args = obj["function"], obj.get("parameters", {})
    elif isinstance(obj.get("function_call"), dict) and len(obj) == 1:
        fc = obj["function_call"]
        name, args = fc.get("name"), fc.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
    else:
        return None
    if not isinstance(name, str) or name not in tools or not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


@dataclass
class OutputParser:
    """Splits a DeepSeek-V4 reply into reasoning, content and tool calls as it is generated.

    Args:
        thinking: the reply starts inside ``<think>`` (thinking mode's generation prompt).
        tools: names of the offered tools whose calls are parsed; empty: no tool parsing (DSML stays content).
        parallel: keep every call of a block; False keeps the first (OpenAI's ``parallel_tool_calls=false``).
        new_id: makes tool-call ids (tests pass a counter).

    Use :meth:`feed` with each piece of text and :meth:`finish` at the end; each returns the new deltas in order.
    :attr:`reasoning`, :attr:`content` and :attr:`tool_calls` hold everything returned so far.

    A malformed block (an element that is not DSML, a function that was not offered, a repeated parameter) ends
    the parsing: the block's text from there on is content, calls already returned stay; text the server forced
    (``feed(..., forced=True)``: the opening of a required call) is not the model's and never becomes content. A block cut off by the
    end of the text keeps the calls and parameters that were complete (an open call's arguments are closed).
    """

    thinking: bool = False
    tools: Collection[str] = ()
    parallel: bool = True
    new_id: Callable[[], str] = new_call_id
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tools = frozenset(self.tools)
        self._state = "reasoning" if self.thinking else "content"
        self._buf = ""
        self._raw = ""          # block text consumed since the last delta (content again if the block is bad)
        self._forced = ""       # forced text at the start of _raw (dropped, not said, if the block is bad)
        self._held = False      # the open call's opening was forced and the model has not confirmed it yet
        self._params: set[str] = set()
        self._call: ToolCall | None = None   # the open invoke
        self._emit_call = True  # False: a non-parallel block's later calls are parsed, not returned
        self._json_hold = bool(self.tools)   # content may yet be a JSON fallback (until a non-'{' starts it)
        self._out: list[Delta] = []

    # -------------------------------------------------------------------------------------------- output
    def _reason(self, text: str) -> None:
        if text:
            self.reasoning += text
            self._out.append(ReasoningDelta(text))

    def _say(self, text: str) -> None:
        if text:
            self.content += text
            self._out.append(ContentDelta(text))

    def _args(self, text: str) -> None:
        if self._held:
            self._emit_open()
        call = self._call
        assert call is not None
        call.arguments += text
        if self._emit_call:
            self._out.append(ToolCallDelta(len(self.tool_calls) - 1, text))

    # -------------------------------------------------------------------------------------------- input
    def feed(self, text: str, forced: bool = False) -> list[Delta]:
        """Take the next piece of generated text (``forced``: text the server put in the model's mouth, a forced
        tool call's opening); returns the deltas it made certain."""
        if forced:
            self._forced = self._raw + self._buf + text
        self._buf += text
        while self._step(final=False):
            pass
        out, self._out = self._out, []
        return out

    def finish(self) -> list[Delta]:
        """The text has ended: returns the held deltas (held reasoning / content, a JSON fallback call, the
        closing of a cut-off call)."""
        while self._step(final=True):
            pass
        st, buf = self._state, self._buf
        if st == "reasoning":
            self._reason(buf)
        elif st in ("content", "raw"):
            if self._json_hold and self.content == "" and (hit := json_fallback_call(buf.strip(), self.tools)):
                self._open_call(*hit)
                self._call = None
            else:
                self._say(buf)
        elif st == "invoke" and self._held:   # cut off before the model wrote any of a forced call: its text
            self._held = False
            self._say((self._raw + buf).removeprefix(self._forced))
        elif st == "invoke":   # cut off inside a call: close the arguments of the complete parameters
            self._args("}" if self._params else "{}")
        # in the block, an unfinished element cut off by the end of the text is dropped
        self._buf = ""
        out, self._out = self._out, []
        return out

    def _open_call(self, name: str, arguments: str = "", held: bool = False) -> None:
        """A call opens. ``held``: the server forced its opening, so it is the model's call only once the model
        writes a parameter or closes it; until then it is not returned (a model that writes something else gets
        its text back as content, no call)."""
        call = ToolCall(self.new_id(), name, arguments)
        self._emit_call = self.parallel or not self.tool_calls
        self._call, self._raw, self._params, self._forced = call, "", set(), ""
        self._held = held
        if not held:
            self._emit_open()

    def _emit_open(self) -> None:
        call = self._call
        assert call is not None
        self._held = False
        if self._emit_call:
            self.tool_calls.append(call)
            self._out.append(ToolCallDelta(len(self.tool_calls) - 1, call.arguments, call.id, call.name))

    def _malformed(self) -> bool:
        """The block does not parse: an open call's arguments are closed, the block's unreturned text is content
        from here on."""
        if self._state == "invoke" and not self._held:
            self._args("}" if self._params else "{}")
        self._held = False      # a forced opening the model did not follow: no call
        text = self._raw + self._buf
        self._say(text.removeprefix(self._forced))
        self._raw, self._buf, self._state, self._call, self._forced = "", "", "raw", None, ""
        return False

    def _step(self, final: bool) -> bool:
        """One move of the state machine over ``_buf``; False when it needs more text."""
        st, buf = self._state, self._buf
        if st == "reasoning":
            ends = (THINK_END, CALLS_SEPARATOR + CALLS_START, CALLS_START) if self.tools else (THINK_END,)
            hit = _earliest(buf, ends)
            if hit is None:
                keep = 0 if final else held_back(buf, ends)
                self._reason(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            i, m = hit
            self._reason(buf[:i])
            self._buf = buf[i + len(m):] if m == THINK_END else buf[i:]
            self._state = "content"
            return True
        if st == "content":
            if not self.tools:
                self._say(buf)
                self._buf = ""
                return False
            starts = (CALLS_SEPARATOR + CALLS_START, CALLS_START)
            hit = _earliest(buf, starts)
            if hit is not None:
                i, m = hit
                self._say(buf[:i])
                self._json_hold = False
                self._raw, self._buf, self._state = buf[i:i + len(m)], buf[i + len(m):], "block"
                return True
            if self._json_hold and self.content == "":
                lead = buf.lstrip()
                if not lead or lead.startswith("{"):
                    return False              # may be a JSON fallback: held to the end
                self._json_hold = False
            keep = 0 if final else held_back(buf, starts)
            self._say(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        if st == "raw":
            self._say(buf)
            self._buf = ""
            return False
        # inside the block: whitespace between elements is markup
        lead = buf.lstrip()
        self._raw += buf[:len(buf) - len(lead)]
        self._buf = buf = lead
        if not buf:
            return False
        if st == "block":
            if buf.startswith(CALLS_END):
                self._raw, self._forced, self._buf, self._state = "", "", buf[len(CALLS_END):], "content"
                return True
            if buf.startswith(INVOKE_START):
                end = buf.find(">")
                if end < 0:
                    return False              # more text, or cut off (finish drops it)
                m = _INVOKE_OPEN.fullmatch(buf[:end + 1])
                if m is None or m.group(1) not in self.tools:
                    return self._malformed()
                self._raw += buf[:end + 1]
                self._buf = buf[end + 1:]
                forced = self._forced[len(self._raw):] if self._forced.startswith(self._raw) else None
                self._open_call(m.group(1), held=forced is not None)
                self._forced = forced or ""   # the forced text after the tag
                self._state = "invoke"
                return True
            if CALLS_END.startswith(buf) or INVOKE_START.startswith(buf):
                return False
            return self._malformed()
        # st == "invoke"
        if buf.startswith(INVOKE_END):
            self._args("}" if self._params else "{}")
            self._raw = ""
            self._buf, self._state, self._call = buf[len(INVOKE_END):], "block", None
            return True
        if buf.startswith(PARAM_START):
            close = buf.find(PARAM_END)
            if close < 0:
                return False                  # more text, or cut off (finish drops it)
            end = buf.find(">")
            m = _PARAM_OPEN.fullmatch(buf[:end + 1])
            if m is None or m.group(1) in self._params:
                return self._malformed()
            name, is_str, raw = m.group(1), m.group(2) == "true", buf[end + 1:close]
            value: object = raw
            if not is_str:
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = raw    # not JSON after all: its text
            first = not self._params
            self._params.add(name)
            self._raw = ""
            self._buf = buf[close + len(PARAM_END):]
            self._args(("{" if first else ", ") + json.dumps(name, ensure_ascii=False) + ": "
                       + json.dumps(value, ensure_ascii=False))
            return True
        if INVOKE_END.startswith(buf) or PARAM_START.startswith(buf):
            return False
        return self._malformed()
