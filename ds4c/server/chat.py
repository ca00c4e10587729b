"""An OpenAI chat request -> the DeepSeek-V4 prompt and how to read the reply (:class:`ChatPlan`).

The prompt is the model file's chat template (:meth:`ds4c.Model.apply_chat_template`, DeepSeek-V4's official
rendering in the V4 GGUFs and the synthetic models) given the messages, ``tools`` and the reasoning switch; this
module decides what goes in:

* **reasoning**: ``reasoning_effort``, ``reasoning: {"effort"}`` or ``chat_template_kwargs: {"reasoning_effort"}``
  (``low``, ``high``, ``max``; ``medium`` and ``xhigh`` are ``high``, as the seed's server maps them for DeepSeek's
  API; ``none`` turns thinking off). An effort turns thinking mode on; ``chat_template_kwargs: {"thinking"}`` (or
  ``enable_thinking``) sets it alone (without an effort no instruction is added, as the seed does); ``low`` is
  thinking without an instruction, ``high`` / ``max`` are passed to the template, which adds the official one.
* **tools** and **tool_choice**: ``auto`` (the default with tools) renders them and parses DSML calls; ``none``
  renders no tools and parses none (the model is not offered them); ``required`` and a named function render them
  and make the reply start with the call: the generation prompt is followed by ``\\n\\n<｜DSML｜tool_calls>\\n``
  (and ``<｜DSML｜invoke name="NAME">\\n``). In thinking mode the reasoning comes first: generation stops at
  ``</think>`` and continues after ``</think>`` and that prefix (:attr:`ChatPlan.forced_after_thinking`), so
  ``required`` works in thinking mode too.
* **messages**: tool results are put in the order of the calls they answer (the official encoding does; llama.cpp
  too), text parts joined, ``name`` dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from ds4c.api import Model
from ds4c.errors import Ds4cError
from ds4c.server.protocol import APIError, ChatCompletionRequest
from ds4c.server.toolcalls import CALLS_START, DSML, THINK_END

#: reasoning effort as requested -> what the template gets (None: thinking without an instruction; "none": off)
EFFORTS = {"none": "none", "low": None, "medium": "high", "high": "high", "xhigh": "high", "max": "max"}
_KWARGS = {"thinking", "enable_thinking", "reasoning_effort"}


@dataclass(frozen=True)
class ChatPlan:
    """What to generate for a chat request and how to read it.

    Attributes:
        prompt: the rendered prompt text (with a forced tool-call prefix when not in thinking mode).
        thinking: the reply starts inside ``<think>``.
        tools: names of the tools whose calls are parsed (empty: none offered, or ``tool_choice`` none).
        forced: the DSML prefix the reply must start with (``""``: none); the parser reads it before the reply.
        forced_after_thinking: thinking mode with a forced call: stop at ``</think>``, then continue the prompt
            with the reasoning, ``</think>`` and :attr:`forced`.
        parallel: all calls of a block are kept (else the first).
    """

    prompt: str
    thinking: bool
    tools: tuple[str, ...]
    forced: str
    forced_after_thinking: bool
    parallel: bool

    @property
    def prefix_text(self) -> str:
        """Text the parser reads before the generated text (the forced prefix when it is in the prompt)."""
        return self.forced if self.forced and not self.forced_after_thinking else ""


def reasoning_mode(req: ChatCompletionRequest) -> tuple[bool | None, str | None]:
    """(thinking, effort for the template) from the request's reasoning fields; thinking None: the template's
    default.

    Raises:
        APIError: an unknown effort, contradicting efforts, a ``chat_template_kwargs`` key other than ``thinking``,
            ``enable_thinking``, ``reasoning_effort``, or a non-bool switch.
    """
    kw = req.chat_template_kwargs or {}
    unknown = set(kw) - _KWARGS
    if unknown:
        raise APIError(400, f"chat_template_kwargs: unsupported key(s) {', '.join(sorted(unknown))} (known: "
                            f"{', '.join(sorted(_KWARGS))})", "chat_template_kwargs", "unsupported_parameter")
    given = {k: v for k, v in (("reasoning_effort", req.reasoning_effort),
                               ("reasoning.effort", req.reasoning.effort if req.reasoning else None),
                               ("chat_template_kwargs.reasoning_effort", kw.get("reasoning_effort")))
             if v is not None}
    for where, v in given.items():
        if not isinstance(v, str) or v not in EFFORTS:
            raise APIError(400, f"{where}: expected one of {', '.join(EFFORTS)}, found {v!r}", where, "invalid_value")
    if len({EFFORTS[v] for v in given.values()}) > 1:
        raise APIError(400, f"reasoning efforts disagree: {given}", next(iter(given)), "invalid_value")
    thinking = kw.get("thinking", kw.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise APIError(400, f"chat_template_kwargs.thinking: expected true or false, found {thinking!r}",
                       "chat_template_kwargs.thinking", "invalid_value")
    if not given:
        return thinking, None
    effort = EFFORTS[next(iter(given.values()))]
    if effort == "none":
        if thinking:
            raise APIError(400, "reasoning effort 'none' with thinking on", "reasoning_effort", "invalid_value")
        return False, None
    if thinking is False:      # thinking off suppresses every effort instruction (the seed's rule)
        return False, None
    return True, effort


def check_tools(req: ChatCompletionRequest) -> list[str]:
    """The offered tools' names, after checking them: unique names, ``parameters`` a valid JSON Schema (draft
    2020-12) of an object; ``tool_choice`` consistent with them.

    Raises:
        APIError: an invalid tool schema, a repeated name, ``tool_choice`` required / named without tools, a named
            tool that is not offered.
    """
    names: list[str] = []
    for i, t in enumerate(req.tools or []):
        f = t.function
        if f.name in names:
            raise APIError(400, f"tools[{i}]: the name {f.name!r} is used twice", f"tools.{i}.function.name")
        names.append(f.name)
        if f.parameters is not None:
            where = f"tools.{i}.function.parameters"
            try:
                Draft202012Validator.check_schema(f.parameters)
            except SchemaError as e:
                raise APIError(400, f"{where}: not a valid JSON Schema ({e.message})", where,
                               "invalid_tool_schema") from None
            except RecursionError:  # the validator recurses per level; the JSON decoder allows ~1000
                raise APIError(400, f"{where}: the schema is nested too deeply to check", where,
                               "invalid_tool_schema") from None
            if f.parameters.get("type", "object") != "object":
                raise APIError(400, f"{where}: expected a schema of type 'object', found "
                                    f"{f.parameters.get('type')!r}", where, "invalid_tool_schema")
    choice = req.tool_choice
    if choice not in (None, "none", "auto") and not names:
        raise APIError(400, "tool_choice requires tools", "tool_choice")
    if not isinstance(choice, (str, type(None))) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                       "tool_choice")
    return names


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the template reads them: text content, tool calls as dicts, tool results in call order, a
    ``developer`` message as ``system`` (as vLLM maps it)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        # OpenAI's newer clients send the system prompt as "developer" (o1 and later); V4's template knows "system"
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        if m.role != "assistant" and m.content is None:
            raise APIError(400, f"messages.{i}.content: a {m.role} message needs content", f"messages.{i}.content")
        if m.role == "assistant":
            if m.content is None and not m.tool_calls:
                raise APIError(400, f"messages.{i}: an assistant message needs content or tool_calls",
                               f"messages.{i}")
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                                 "arguments": c.function.arguments}}
                                   for c in m.tool_calls]
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
        if m.role == "tool" and m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return _results_in_call_order(out)


def _results_in_call_order(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results ordered as the previous assistant message's calls (by ``tool_call_id``; unknown
    ids first, stable) - DeepSeek-V4's encoding renders them in call order."""
    order: dict[str, int] = {}
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m["role"] == "assistant":
            order = {c["id"]: k for k, c in enumerate(m.get("tool_calls") or []) if c.get("id")}
        if m["role"] != "tool":
            i += 1
            continue
        j = i
        while j < len(msgs) and msgs[j]["role"] == "tool":
            j += 1
        msgs[i:j] = sorted(msgs[i:j], key=lambda t: order.get(t.get("tool_call_id") or "", -1))
        i = j
    return msgs


def plan_chat(model: Model, req: ChatCompletionRequest, raw_tools: list[dict[str, Any]] | None = None) -> ChatPlan:
    """The :class:`ChatPlan` of ``req`` on ``model``; ``raw_tools``: the request's ``tools`` as sent (rendered as
    given, keys in the client's order, as the official encoding does; ``req.tools`` when None).

    Raises:
        APIError: bad reasoning fields, tools, tool_choice or messages (see above); the template refusing the
            conversation or the effort (400, its one-line message).
    """
    thinking, effort = reasoning_mode(req)
    names = check_tools(req)
    choice = req.tool_choice or ("auto" if names else "none")
    offered = names if choice != "none" else []
    if raw_tools is None:
        raw_tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    tools = raw_tools if offered else None
    try:
        prompt = model.apply_chat_template(_messages(req), add_generation_prompt=True, thinking=thinking,
                                           reasoning_effort=effort, tools=tools)
    except Ds4cError as e:
        raise APIError(400, " ".join(str(e).split()), "messages", "invalid_conversation") from None
    in_thinking = prompt.endswith("<think>")
    forced = ""
    if choice == "required" or not isinstance(choice, str):
        forced = f"\n\n{CALLS_START}\n"
        if not isinstance(choice, str):
            forced += f'<{DSML}invoke name="{choice.function.name}">\n'
    after = bool(forced) and in_thinking
    return ChatPlan(prompt=prompt + (forced if forced and not after else ""), thinking=in_thinking,
                    tools=tuple(offered), forced=forced, forced_after_thinking=after,
                    parallel=req.parallel_tool_calls is not False)


def continuation(plan: ChatPlan, reasoning: str) -> str:
    """The prompt of the second part of a :attr:`ChatPlan.forced_after_thinking` reply: the prompt, the reasoning
    generated, ``</think>`` and the forced call prefix."""
    return plan.prompt + reasoning + THINK_END + plan.forced
