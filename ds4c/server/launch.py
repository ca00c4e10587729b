"""Run the server: open a model (:func:`serve`) or take an opened one (:func:`serve_model`), put it behind
:func:`~ds4c.server.app.create_app` on uvicorn, and run until SIGTERM / SIGINT.

A shutdown signal drains the server: the scheduler refuses new requests (503, ``draining``), uvicorn stops
listening and waits up to ``drain_timeout_s`` for the requests in flight (queued ones included) to finish, then the
engine is closed.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from sse_starlette.sse import AppStatus

from ds4c.api import Model
from ds4c.errors import Ds4cError
from ds4c.generate import check_spec_width
from ds4c.server.app import ServerOptions, create_app
from ds4c.server.engine import SerialEngine
from ds4c.server.scheduler import Scheduler, SchedulerConfig

__all__ = ["serve", "serve_model", "DEFAULT_PORT"]

DEFAULT_PORT = 8000


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the scheduler to drain when a shutdown signal arrives and saying where it
    listens once it does (``port`` 0 picks a free port): ``ds4c serve: listening on http://HOST:PORT`` on stderr."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler):
        super().__init__(config)
        self._scheduler = scheduler

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._scheduler.drain()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                print(f"ds4c serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)


def serve_model(model: Model, options: ServerOptions, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                max_concurrency: int | None = None, spec_width: int | str = 5, drain_timeout_s: float = 30.0,
                log_level: str = "info") -> None:
    """Serve an opened ``model`` until SIGTERM / SIGINT (then drain, module docstring).

    Args:
        model: the opened model (with a tokenizer); the server's engine owns it from here on. Its ``draft`` (if
            opened with one) decodes every request speculatively.
        options: model name, API key, body and scheduler limits (:class:`~ds4c.server.app.ServerOptions`).
        host, port: where to listen (127.0.0.1 unless told otherwise; port 0: a free port, printed).
        max_concurrency: sequences run at once; None: the engine's capacity.
        spec_width: verify rows per speculative step (with a drafter), 1..5 or ``"auto"``.
        drain_timeout_s: how long a shutdown waits for requests in flight.
        log_level: uvicorn's log level (``critical`` ... ``debug``).

    Raises:
        Ds4cError: a model without tokenizer; ``max_concurrency`` beyond what the engine runs at once; a
            ``spec_width`` outside 1..5 / ``"auto"`` (StepError).
    """
    check_spec_width(spec_width)
    if model.tokenizer is None:
        raise Ds4cError(f"{model.path}: the file has no tokenizer (written by ds4c before 0.2?); the server speaks "
                        f"text")
    engine = SerialEngine(model, spec_width=spec_width)
    if max_concurrency is not None and max_concurrency != engine.capacity:
        engine.close()
        raise Ds4cError(f"max_concurrency {max_concurrency}: this engine runs {engine.capacity} sequence at a time "
                        f"(requests queue for it); more at once needs the multi-sequence engine")
    app = create_app(model, engine, options)
    # sse-starlette ends every event stream at a shutdown signal by default; ds4c drains them instead
    AppStatus.disable_automatic_graceful_drain()
    logging.getLogger("ds4c.server").setLevel(log_level.upper())
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout_s)
    _DrainingServer(config, app.state.scheduler).run()


def serve(model_path: str | os.PathLike[str] | None = None, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          max_concurrency: int | None = None, api_key: str | None = None, model_name: str | None = None,
          device: str = "cpu", engine: str = "auto", artifact: str | os.PathLike[str] | None = None,
          max_ctx: int | None = None, threads: int | None = None, dataflow: str = "bf16",
          devices: str | Sequence[str] | None = None, layer_split: str | Sequence[int] | None = None,
          prefill_chunks: Any = None, draft: str | None = None, spec_width: int | str = 5,
          max_queue: int = SchedulerConfig.max_queue, queue_timeout_s: float = SchedulerConfig.queue_timeout_s,
          request_timeout_s: float | None = SchedulerConfig.request_timeout_s,
          stream_buffer: int = SchedulerConfig.stream_buffer, max_body_bytes: int = ServerOptions.max_body_bytes,
          drain_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Open the model at ``model_path`` and serve it with OpenAI's API until SIGTERM / SIGINT (docs/serving.md).

    Args:
        model_path: a GGUF file, a ``synthetic:...`` spec, or None (the built-in default model).
        host, port: where to listen (127.0.0.1 unless told otherwise; port 0: a free port, printed on stderr).
        max_concurrency: sequences run at once (None: the engine's capacity; today's engine runs 1, the rest
            queue).
        api_key: the bearer token every route but ``/health`` needs (None: none).
        model_name: the id clients name in ``model`` (default: the file's name without ``.gguf``).
        device, engine, artifact, max_ctx, threads, dataflow, devices, layer_split, prefill_chunks, draft: as
            :class:`ds4c.Model` takes them (``max_ctx``: positions a sequence may hold, prompt + reply; None: the
            artifact's, else 4096; ``draft``: speculative decoding for every request).
        spec_width: with ``draft``: verify rows per step, 1..5 or ``"auto"``.
        max_queue, queue_timeout_s, request_timeout_s, stream_buffer: the scheduler's limits
            (:class:`~ds4c.server.scheduler.SchedulerConfig`).
        max_body_bytes: larger request bodies get 413.
        drain_timeout_s: how long a shutdown waits for requests in flight.
        log_level: uvicorn's log level.

    Raises:
        Ds4cError: an empty ``api_key``; what :class:`ds4c.Model` raises; what :func:`serve_model` raises.
    """
    if api_key is not None and not api_key.strip():
        raise Ds4cError("api_key: expected a non-empty key")
    check_spec_width(spec_width)  # before the (possibly long) model start, as every other argument
    model = Model(model_path, device=device, artifact=artifact, max_ctx=max_ctx, engine=engine, threads=threads,
                  dataflow=dataflow, devices=devices, layer_split=layer_split, prefill_chunks=prefill_chunks,
                  draft=draft)
    name = model_name or Path(str(model.path)).name.removesuffix(".gguf")
    options = ServerOptions(model_name=name, api_key=api_key, max_body_bytes=max_body_bytes,
                            scheduler=SchedulerConfig(max_queue=max_queue, queue_timeout_s=queue_timeout_s,
                                                      request_timeout_s=request_timeout_s,
                                                      stream_buffer=stream_buffer))
    print(f"ds4c serve: {name} ({model.engine} engine on {device}, max_ctx {model.max_ctx}; loaded in "
          f"{model.load_s:.1f} s){', API key required' if api_key else ''}", file=sys.stderr, flush=True)
    serve_model(model, options, host=host, port=port, max_concurrency=max_concurrency, spec_width=spec_width,
                drain_timeout_s=drain_timeout_s, log_level=log_level)
