"""Run the server: open a model (:func:`serve`) or take an opened one (:func:`serve_model`), put it behind
:func:`~ds4c.server.app.create_app` on uvicorn, and run until SIGTERM / SIGINT.

The listening socket is bound before the model loads, so a port in use is a one-line error at once, not after
minutes of loading.

A shutdown signal drains the server: it keeps listening, and new requests get 503 (``draining``) while the
requests in flight (queued ones included) finish, for up to ``drain_timeout_s``; the ones still running then are
stopped, each ending with OpenAI's error object (503 ``draining``; an error event and ``[DONE]`` in a stream).
Then uvicorn stops listening and the engine is closed. A second signal stops waiting.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from sse_starlette.sse import AppStatus

from ds4c.api import Model
from ds4c.errors import Ds4cError
from ds4c.generate import check_spec_width
from ds4c.server.app import ServerOptions, create_app
from ds4c.server.engine import BatchedEngine, SerialEngine
from ds4c.server.scheduler import Scheduler, SchedulerConfig

__all__ = ["serve", "serve_model", "listen", "DEFAULT_PORT"]

DEFAULT_PORT = 8000

#: Seconds the requests stopped at the drain timeout get to send their error and close, and uvicorn's own grace
#: for connections after that.
_ABORT_GRACE_S = 5.0

log = logging.getLogger("ds4c.server")


def _check_drain_timeout(seconds: float) -> None:
    if not (math.isfinite(seconds) and seconds >= 0):
        raise Ds4cError(f"drain_timeout_s: expected a finite number of seconds >= 0, found {seconds}")


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (port 0: a free one), bound now so that a port in use or a bad
    address is known before the model loads.

    Raises:
        Ds4cError: the address cannot be used (in use, not this machine's, not resolvable).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise Ds4cError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as e:
        sock.close()
        raise Ds4cError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on a shutdown signal (module docstring) before uvicorn's own shutdown, and
    saying where it listens once it does: ``ds4c serve: listening on http://HOST:PORT`` on stderr."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout_s: float):
        super().__init__(config)
        self._scheduler, self._drain_timeout_s = scheduler, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining is None and self._loop is not None and not self.should_exit:
            self._scheduler.drain()
            self._draining = self._loop.create_task(self._drain(sig))
        else:                          # a second signal, or one before start-up ended: uvicorn's shutdown now
            super().handle_exit(sig, frame)

    async def _drain(self, sig: int) -> None:
        """Wait for the scheduler to empty (at most the drain timeout), stop what still runs, then shut down."""
        sched = self._scheduler
        deadline = time.monotonic() + self._drain_timeout_s
        while not sched.idle and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if not sched.idle and not self.should_exit:
            n = sched.abort()
            log.warning("drain timeout (%g s): stopping %d request(s) still running", self._drain_timeout_s, n)
            deadline = time.monotonic() + _ABORT_GRACE_S
            while not sched.idle and time.monotonic() < deadline and not self.should_exit:
                await asyncio.sleep(0.05)
        if not self.should_exit:       # (a second signal has already shut it down)
            super().handle_exit(sig, None)

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                print(f"ds4c serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)


def serve_model(model: Model, options: ServerOptions, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                max_concurrency: int | None = None, spec_width: int | str = 5, drain_timeout_s: float = 30.0,
                log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Serve an opened ``model`` until SIGTERM / SIGINT (then drain, module docstring).

    Args:
        model: the opened model (with a tokenizer); the server's engine owns it from here on. Its ``draft`` (if
            opened with one) decodes every request speculatively.
        options: model name, API key, body and scheduler limits (:class:`~ds4c.server.app.ServerOptions`).
        host, port: where to listen (127.0.0.1 unless told otherwise; port 0: a free port, printed).
        max_concurrency: sequences run at once; None: the engine's capacity (the model's ``lanes``, else 1).
        spec_width: verify rows per speculative step (with a drafter), 1..5 or ``"auto"``.
        drain_timeout_s: how long a shutdown waits for requests in flight.
        log_level: uvicorn's log level (``critical`` ... ``debug``).
        sock: a listening socket (:func:`listen`) to serve on instead of ``host`` / ``port``; closed when this
            returns.

    Raises:
        Ds4cError: ``host`` / ``port`` cannot be listened on (:func:`listen`); a model without tokenizer;
            ``max_concurrency`` beyond what the engine runs at once; a ``spec_width`` outside 1..5 / ``"auto"``
            (StepError).
    """
    if sock is None:
        _check_drain_timeout(drain_timeout_s)
        sock = listen(host, port)
    try:
        _check_drain_timeout(drain_timeout_s)
        check_spec_width(spec_width)
        if model.tokenizer is None:
            raise Ds4cError(f"{model.path}: the file has no tokenizer (written by ds4c before 0.2?); the server "
                            f"speaks text")
        if model.batch is not None:  # lanes: continuous batching, a worker per sequence slot
            if model.draft is not None and spec_width == "auto":
                raise Ds4cError("--spec-width auto: speculative rows in a batch take a fixed width (1..5)")
            engine: SerialEngine = BatchedEngine(model, capacity=max_concurrency or model.batch.config.max_lanes,
                                                 spec_width=spec_width)
        else:
            if max_concurrency is not None and max_concurrency != 1:
                raise Ds4cError(f"max_concurrency {max_concurrency}: without --lanes the engine runs 1 sequence at "
                                f"a time (requests queue for it); --lanes N runs N at once")
            engine = SerialEngine(model, spec_width=spec_width)
        app = create_app(model, engine, options)
        # sse-starlette ends every event stream at a shutdown signal by default; ds4c drains them instead
        AppStatus.disable_automatic_graceful_drain()
        logging.getLogger("ds4c.server").setLevel(log_level.upper())
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=_ABORT_GRACE_S)
        _DrainingServer(config, app.state.scheduler, drain_timeout_s).run(sockets=[sock])
    finally:
        sock.close()


def serve(model_path: str | os.PathLike[str] | None = None, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          max_concurrency: int | None = None, api_key: str | None = None, model_name: str | None = None,
          device: str = "cpu", engine: str = "auto", artifact: str | os.PathLike[str] | None = None,
          max_ctx: int | None = None, threads: int | None = None, dataflow: str = "bf16",
          devices: str | Sequence[str] | None = None, layer_split: str | Sequence[int] | None = None,
          prefill_chunks: Any = None, draft: str | None = None, spec_width: int | str = 5,
          lanes: Any = None,
          max_queue: int = SchedulerConfig.max_queue, queue_timeout_s: float = SchedulerConfig.queue_timeout_s,
          request_timeout_s: float | None = SchedulerConfig.request_timeout_s,
          stream_buffer: int = SchedulerConfig.stream_buffer, max_body_bytes: int = ServerOptions.max_body_bytes,
          drain_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Open the model at ``model_path`` and serve it with OpenAI's API until SIGTERM / SIGINT (docs/serving.md).

    Args:
        model_path: a GGUF file, a ``synthetic:...`` spec, or None (the built-in default model).
        host, port: where to listen (127.0.0.1 unless told otherwise; port 0: a free port, printed on stderr).
        max_concurrency: sequences run at once (None: the engine's capacity: ``lanes``, else 1; the rest queue).
        api_key: the bearer token every route but ``/health`` needs (None: none).
        model_name: the id clients name in ``model`` (default: the file's name without ``.gguf``).
        device, engine, artifact, max_ctx, threads, dataflow, devices, layer_split, prefill_chunks, draft: as
            :class:`ds4c.Model` takes them (``max_ctx``: positions a sequence may hold, prompt + reply; None: the
            artifact's, else 4096; ``draft``: speculative decoding for every request).
        spec_width: with ``draft``: verify rows per step, 1..5 or ``"auto"``.
        lanes: sequences stepped together (continuous batching with prefix reuse, :class:`ds4c.Model`'s ``lanes``:
            the compiled step's decode lanes on cuda, the reference's paged pool on cpu; a drafter on the reference
            only: the oracle, the MTP block or DSpark), or a :class:`~ds4c.batching.BatchConfig` (its prompt policy
            beside decoding sequences too); None: one at a time.
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
    if api_key is not None:
        api_key = api_key.strip()     # as the presented token is: a stray space would refuse every request
    _check_drain_timeout(drain_timeout_s)
    limits = SchedulerConfig(max_queue=max_queue, queue_timeout_s=queue_timeout_s,  # checked before the model loads
                             request_timeout_s=request_timeout_s, stream_buffer=stream_buffer)
    check_spec_width(spec_width)  # before the (possibly long) model start, as every other argument
    sock = listen(host, port)
    try:
        model = Model(model_path, device=device, artifact=artifact, max_ctx=max_ctx, engine=engine, threads=threads,
                      dataflow=dataflow, devices=devices, layer_split=layer_split, prefill_chunks=prefill_chunks,
                      draft=draft, lanes=lanes)
    except BaseException:
        sock.close()
        raise
    name = model_name or Path(str(model.path)).name.removesuffix(".gguf")
    options = ServerOptions(model_name=name, api_key=api_key, max_body_bytes=max_body_bytes,
                            scheduler=limits)
    lanes_note = f", {model.batch.config.max_lanes} lanes" if model.batch is not None else ""
    print(f"ds4c serve: {name} ({model.engine} engine on {device}{lanes_note}, max_ctx {model.max_ctx}; loaded in "
          f"{model.load_s:.1f} s){', API key required' if api_key else ''}", file=sys.stderr, flush=True)
    serve_model(model, options, max_concurrency=max_concurrency, spec_width=spec_width,
                drain_timeout_s=drain_timeout_s, log_level=log_level, sock=sock)
