"""Chat prompts: a conversation rendered by the file's ``tokenizer.chat_template`` (jinja2, sandboxed), with the
rules that keep a template from silently dropping what the caller asked for.

* Roles: ``system``, ``user`` and ``assistant``. A ``tool`` message (a tool's result) is refused in one line
  until tool calls are supported (the server issue adds them): templates that do not know the role drop it from
  the prompt, so the model would never see it. Any other role is refused the same way.
* ``reasoning_effort`` must change the rendered prompt: DeepSeek-V4's template writes it only with thinking on,
  so without ``thinking=True`` (``ds4c generate --think``) it would be ignored; the error says so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from ds4c.errors import Ds4cError

if TYPE_CHECKING:  # the type only: the tokenizer module is imported where a file's tokenizer is opened
    from ds4c.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")


def render_chat(tok: Tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                thinking: bool | None = None, reasoning_effort: str | None = None, source: str = "the model") -> str:
    """The prompt text of ``messages``: ``tok.chat_template`` rendered in an ``ImmutableSandboxedEnvironment``
    with ``messages``, ``add_generation_prompt``, ``bos_token`` / ``eos_token`` and, when given, ``thinking`` and
    ``reasoning_effort`` (module docstring: the rules).

    Raises:
        Ds4cError: ``tok`` has no chat template (``source`` names the file); messages that are not a non-empty list
            of ``{"role": str, "content": str}`` dicts, or of a role other than system / user / assistant (a
            ``tool`` message: not supported yet); a ``reasoning_effort`` the template does not read or know, or
            that leaves the prompt unchanged (thinking off); the template fails to render (its message, on one
            line).
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
        if m["role"] == "tool":
            raise Ds4cError(f"messages[{i}]: role 'tool' (a tool's result) is not supported yet: tool calls are not "
                            f"implemented, and the chat template would drop the message from the prompt")
        if m["role"] not in ROLES:
            raise Ds4cError(f"messages[{i}]: expected role {', '.join(map(repr, ROLES))}, found {m['role']!r}")
    var: dict[str, Any] = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt,
                           "bos_token": "" if tok.bos_id is None else tok.decode([tok.bos_id]),
                           "eos_token": "" if tok.eos_id is None else tok.decode([tok.eos_id])}
    if thinking is not None:
        var["thinking"] = bool(thinking)
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


def _render(template: str, var: dict[str, Any], source: str) -> str:
    def raise_exception(msg: str) -> None:
        raise Ds4cError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(**var)
    except Ds4cError:
        raise
    except Exception as e:  # jinja2.TemplateError (the sandbox's SecurityError included) or the template's own
        raise Ds4cError(f"{source}: the chat template does not render ({type(e).__name__}: {e})") from None


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
