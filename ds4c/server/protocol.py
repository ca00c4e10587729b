"""OpenAI's request bodies (pydantic models) and error objects, as ``ds4c serve`` accepts and returns them.

Requests are validated strictly (``"max_tokens": "5"`` is an error, not 5); fields OpenAI defines but ds4c does not
implement are refused when honouring them would change the result (``n`` > 1, ``logprobs``, penalties,
``logit_bias``, JSON ``response_format``, the deprecated ``functions`` / ``function_call``, ``echo``, ``suffix``,
``best_of`` > 1), and ignored when they do not
(``user``, ``metadata``, ``store``, ``service_tier``); unknown fields are ignored, as vLLM does. Every refusal is an
:class:`APIError`: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "Message", "Tool", "parse_body",
           "MAX_STOP_STRINGS"]

MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered as OpenAI's error object.

    Args:
        status: the HTTP status (400 bad request, 401 no or wrong key, 404 unknown model or route, 408 request
            timeout, 413 body too large, 429 queue full, 503 draining).
        message: one line for the client.
        param: the request field at fault (``"messages.0.content"``), if any.
        code: a short machine-readable code (``"context_length_exceeded"``...); by default from the status
            (``invalid_value``, ``not_found``, ``method_not_allowed``, ``internal_error``...).
        type: OpenAI's error type; by default from the status.
    """

    _TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
              405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
              429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
    _CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
              408: "request_timeout", 413: "request_too_large", 500: "internal_error", 503: "unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or self._CODES.get(status)
        self.type = type or self._TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# ------------------------------------------------------------------------------------------------ chat
class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """One chat message. ``content``: a str or OpenAI's text parts (``[{"type": "text", "text": ...}]``, joined
    with newlines); an assistant message may carry ``tool_calls`` and ``reasoning_content`` instead, a ``tool``
    message answers ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if isinstance(v, list):
            texts = []
            for i, part in enumerate(v):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: only text parts ({{'type': 'text', 'text': str}}) are supported, "
                                     f"found type {part.get('type')!r}")
                texts.append(part["text"])
            return "\n".join(texts)
        return v


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Strict):
    class _Name(_Strict):
        name: str

    type: Literal["function"]
    function: _Name


class StreamOptions(_Strict):
    include_usage: bool = False


class ReasoningOptions(_Open):
    effort: str | None = None


class _Sampling(_Strict):
    """The sampling fields chat and completions share."""

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, Any] | None = None
    ignore_eos: bool = False
    user: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, found {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    def refuse_unsupported(self) -> None:
        """Raises APIError (400) for a field whose value ds4c cannot honour."""
        if self.n not in (None, 1):
            raise APIError(400, f"n = {self.n}: ds4c serve returns one choice per request (n = 1)", "n",
                           "unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (0 only)", name, "unsupported_parameter")
        if self.repetition_penalty not in (None, 1, 1.0):
            raise APIError(400, "repetition_penalty is not supported (1 only)", "repetition_penalty",
                           "unsupported_parameter")
        if self.min_p not in (None, 0, 0.0):
            raise APIError(400, "min_p is not supported (0 only)", "min_p", "unsupported_parameter")
        if self.stop_token_ids:
            raise APIError(400, "stop_token_ids is not supported (give stop strings)", "stop_token_ids",
                           "unsupported_parameter")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream = true", "stream_options")

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    reasoning: ReasoningOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    functions: Any = None
    function_call: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs is not None:
            name = "logprobs" if self.logprobs else "top_logprobs"
            raise APIError(400, "logprobs are not supported", name, "unsupported_parameter")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(400, f"response_format {self.response_format.get('type')!r} is not supported (only "
                                f"'text')", "response_format", "unsupported_parameter")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} (OpenAI's deprecated function calling) is not supported: give tools and "
                                    f"tool_choice", name, "unsupported_parameter")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; give one", "max_tokens")

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a str, token ids, or a list of one of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", "echo", "unsupported_parameter")
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported", "logprobs", "unsupported_parameter")
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix", "unsupported_parameter")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", "best_of", "unsupported_parameter")

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of several prompts is refused: one choice per request)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: one prompt per request, found {len(p)}", "prompt",
                               "unsupported_parameter")
            p = p[0]
        if not p:
            raise APIError(400, "prompt: expected a non-empty str or token ids", "prompt")
        return p


# ------------------------------------------------------------------------------------------------ parsing
def _where(loc: tuple) -> str:
    """``("messages", 0, "content")`` -> ``"messages.0.content"`` (pydantic's union branch names dropped)."""
    keep = [str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in {"str", "int", "float", "bool",
                                                                                  "list", "dict", "none"}))]
    return ".".join(keep)


def parse_body(raw: bytes, model: type[BaseModel]) -> tuple[Any, dict[str, Any]]:
    """The request body as ``model``, and as parsed JSON; APIError (400) for malformed JSON (nested deeper than
    Python's recursion limit included), a body that is not an object, or a field of the wrong type or out of range
    (the first error, with its ``param``)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        if "int_max_str_digits" in str(e):   # Python's guard against quadratic int parsing
            raise APIError(400, "a number in the body has too many digits", code="invalid_value") from None
        raise APIError(400, f"the body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:  # json's decoder recurses per nesting level: a body of 100,000 '[' exhausts the stack
        raise APIError(400, "the body is not valid JSON here: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, found {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data), data
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = _where(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{where}: {msg}" if where else msg, where or None, "invalid_value") from None
