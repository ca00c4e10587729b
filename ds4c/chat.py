"""Chat prompts: a conversation rendered by the file's ``tokenizer.chat_template`` (jinja2, sandboxed), with the
rules that keep a template from silently dropping what the caller asked for.

* Roles: ``system``, ``user``, ``assistant`` and ``tool`` (a tool's result); any other role is refused in one line.
* Tool conversations (OpenAI's shapes): an assistant message's ``tool_calls`` (``[{"id", "type": "function",
  "function": {"name", "arguments": a JSON object or its text}}]``), a ``tool`` message's ``tool_call_id``, and
  ``tools`` (``[{"type": "function", "function": {"name", "description", "parameters"}}]``). A template that does
  not know them would drop them from the prompt, so the model would never see them: each tool result, call and
  offered tool must show in the rendered prompt (checked by rendering once with marker texts in their place),
  else the conversation is refused in one line. DeepSeek-V4's template renders all of them (DSML calls).
* The ``tojson`` and ``from_json`` filters are HuggingFace's and llama.cpp's (``json.dumps(..., ensure_ascii=False)``
  with keys in their order; ``json.loads``), which DeepSeek-V4's template renders schemas and arguments with
  (jinja2's own ``tojson`` sorts keys and escapes HTML characters, which the official encoding does not).
* ``reasoning_effort`` must change the rendered prompt: DeepSeek-V4's template writes it only with thinking on,
  so without ``thinking=True`` (``ds4c generate --think``) it would be ignored; the error says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from ds4c.errors import Ds4cError

if TYPE_CHECKING:  # the type only: the tokenizer module is imported where a file's tokenizer is opened
    from ds4c.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")

#: What a marker text of :func:`render_chat`'s check starts with (a text no conversation has by chance).
_PROBE = "ds4c-probe-7f3a"


def render_chat(tok: Tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                thinking: bool | None = None, reasoning_effort: str | None = None, source: str = "the model",
                tools: Sequence[dict[str, Any]] | None = None) -> str:
    """The prompt text of ``messages``: ``tok.chat_template`` rendered in an ``ImmutableSandboxedEnvironment``
    with ``messages``, ``add_generation_prompt``, ``bos_token`` / ``eos_token`` and, when given, ``thinking``,
    ``reasoning_effort`` and ``tools`` (module docstring: the rules).

    Raises:
        Ds4cError: ``tok`` has no chat template (``source`` names the file); messages that are not a non-empty list
            of ``{"role": str, "content": str}`` dicts, or of a role other than system / user / assistant / tool;
            tool calls whose arguments are not a JSON object; ``tools`` not a list of dicts; a tool result, call or
            tool the template does not render; a ``reasoning_effort`` the template does not read or know, or that
            leaves the prompt unchanged (thinking off); the template fails to render (its message, on one line).
    """
    if tok.chat_template is None:
        raise Ds4cError(f"{source}: the file has no tokenizer.chat_template; use generate() with a prompt")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise Ds4cError("messages: expected a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content", ""), (str, type(None))):
            raise Ds4cError(f"messages[{i}]: expected a dict with a str 'role' and a str 'content', found "
                            f"{str(m)[:80]}")
        if m["role"] not in ROLES:
            raise Ds4cError(f"messages[{i}]: expected role {', '.join(map(repr, ROLES))}, found {m['role']!r}")
        _check_tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls")
    if tools is not None and (isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence)
                              or not all(isinstance(t, dict) for t in tools)):
        raise Ds4cError(f"tools: expected a list of {{'type': 'function', 'function': {{...}}}} dicts, found "
                        f"{str(tools)[:80]}")
    var: dict[str, Any] = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt,
                           "bos_token": "" if tok.bos_id is None else tok.decode([tok.bos_id]),
                           "eos_token": "" if tok.eos_id is None else tok.decode([tok.eos_id])}
    if thinking is not None:
        var["thinking"] = bool(thinking)
    if tools:
        var["tools"] = [dict(t) for t in tools]
    _check_tool_parts_shown(tok.chat_template, var, source)
    text = _render(tok.chat_template, var, source)
    if reasoning_effort is None:
        return text
    effort = _check_reasoning_effort(tok.chat_template, reasoning_effort)
    with_effort = _render(tok.chat_template, {**var, "reasoning_effort": effort}, source)
    if with_effort == text:
        how = ("it only with thinking on: pass thinking=True (ds4c generate --think)" if not thinking else
               "it only in other conversations")
        raise Ds4cError(f"reasoning_effort {effort!r} would change nothing in the prompt: the chat template uses "
                        f"{how}")
    return with_effort


def _check_tool_calls(calls: Any, where: str) -> None:
    """Raises Ds4cError unless ``calls`` is None or a list of ``{"function": {"name": str, "arguments": a JSON
    object or its text}}`` dicts (what a chat template renders as the assistant's tool calls)."""
    if calls is None:
        return
    if not isinstance(calls, (list, tuple)):
        raise Ds4cError(f"{where}: expected a list of tool calls, found {str(calls)[:80]}")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise Ds4cError(f"{where}[{j}]: expected {{'function': {{'name': str, 'arguments': ...}}}}, found "
                            f"{str(c)[:80]}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                raise Ds4cError(f"{where}[{j}].function.arguments: expected a JSON object, found "
                                f"{fn['arguments'][:80]!r}") from None
        if not isinstance(args, dict):
            raise Ds4cError(f"{where}[{j}].function.arguments: expected a JSON object, found {str(args)[:80]}")


def _check_tool_parts_shown(template: str, var: dict[str, Any], source: str) -> None:
    """Raises Ds4cError when the template would drop a tool result, a tool call or an offered tool: one render
    with a marker text in place of each (a result's content, a call's and a tool's function name) must show every
    marker. Nothing to check (no render) in a conversation without them."""
    probes: dict[str, str] = {}
    msgs = []
    for i, m in enumerate(var["messages"]):
        m = dict(m)
        if m["role"] == "tool":
            m["content"] = f"{_PROBE}-result-{i}"
            probes[m["content"]] = f"messages[{i}] (a tool result)"
        if m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                name = f"{_PROBE}-call-{i}-{j}"
                probes[name] = f"messages[{i}].tool_calls[{j}]"
                calls.append({**c, "function": {**c["function"], "name": name}})
            m["tool_calls"] = calls
        msgs.append(m)
    tools = []
    for k, t in enumerate(var.get("tools") or ()):
        name = f"{_PROBE}-tool-{k}"
        probes[name] = f"tools[{k}]"
        fn = t.get("function")
        tools.append({**t, "function": {**fn, "name": name} if isinstance(fn, dict) else {"name": name}})
    if not probes:
        return
    text = _render(template, {**var, "messages": msgs, **({"tools": tools} if tools else {})}, source)
    missing = [what for p, what in probes.items() if p not in text]
    if missing:
        raise Ds4cError(f"{missing[0]}: the chat template does not render it (it would be dropped from the prompt"
                        f"{f'; {len(missing) - 1} more like it' if len(missing) > 1 else ''}); this model's template "
                        f"does not support tool calls")


def _render(template: str, var: dict[str, Any], source: str) -> str:
    def raise_exception(msg: str) -> None:
        raise Ds4cError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads
    try:
        return env.from_string(template).render(**var)
    except Ds4cError:
        raise
    except Exception as e:  # jinja2.TemplateError (the sandbox's SecurityError included) or the template's own
        raise Ds4cError(f"{source}: the chat template does not render ({type(e).__name__}: {e})") from None


def _tojson(value: Any, indent: int | None = None) -> str:
    """The ``tojson`` filter of HuggingFace's chat templates: JSON with non-ASCII kept and keys in their order."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _check_reasoning_effort(template: str, value: Any) -> str:
    """``value`` when the chat template can use it: the template must read ``reasoning_effort`` and, when it
    compares it with a list or literals (``reasoning_effort in ['high', 'max']``), ``value`` must be one of them
    (else the template would silently ignore it).

    Raises:
        Ds4cError: a template without the variable, or a value it does not know (one line, the known values).
    """
    v = str(value)
    if "reasoning_effort" not in template:
        raise Ds4cError(f"reasoning_effort {v!r}: the file's chat template has no reasoning_effort variable (it would "
                        f"be ignored)")
    known: list[str] = []
    for m in re.finditer(r"reasoning_effort\s+in\s+[\[(]([^\])]*)[\])]", template):
        known += re.findall(r"['\"]([^'\"]+)['\"]", m.group(1))
    known += re.findall(r"reasoning_effort\s*==\s*['\"]([^'\"]+)['\"]", template)
    if known and v not in known:
        raise Ds4cError(f"reasoning_effort: expected one of the values the chat template knows "
                        f"({', '.join(dict.fromkeys(known))}), found {v!r}")
    return v
