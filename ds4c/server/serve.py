"""Run the server: an opened :class:`ds4c.Model` behind :func:`~ds4c.server.app.create_app` on uvicorn.

SIGTERM / SIGINT drain the server: the scheduler refuses new requests (503), uvicorn stops listening and waits up
to ``drain_timeout_s`` for the requests in flight (queued ones included) to finish, then the engine is closed.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import uvicorn
from sse_starlette.sse import AppStatus

from ds4c.api import Model
from ds4c.errors import Ds4cError
from ds4c.server.app import ServerOptions, create_app
from ds4c.server.engine import SerialEngine
from ds4c.server.scheduler import Scheduler

__all__ = ["serve"]


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the scheduler to drain when a shutdown signal arrives and saying where it
    listens once it does (``--port 0`` picks a free port)."""

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


def serve(model: Model, options: ServerOptions, host: str = "127.0.0.1", port: int = 8000,
          max_concurrency: int | None = None, draft: Any = None, spec_width: int | str = 5,
          drain_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Serve ``model`` until SIGTERM / SIGINT (then drain, module docstring).

    Args:
        model: the opened model; the server's engine owns it from here on.
        options: model name, API key, body and scheduler limits (:class:`~ds4c.server.app.ServerOptions`).
        host, port: where to listen (127.0.0.1 unless told otherwise; port 0: a free port, printed).
        max_concurrency: sequences run at once; None: the engine's capacity.
        draft, spec_width: speculative decoding for every request (:class:`~ds4c.server.engine.SerialEngine`).
        drain_timeout_s: how long a shutdown waits for requests in flight.
        log_level: uvicorn's log level.

    Raises:
        Ds4cError: ``max_concurrency`` beyond what the engine runs at once.
    """
    engine = SerialEngine(model, draft=draft, spec_width=spec_width)
    if max_concurrency is not None and max_concurrency != engine.capacity:
        engine.close()
        raise Ds4cError(f"--max-concurrency {max_concurrency}: this engine runs {engine.capacity} sequence at a time "
                        f"(requests queue for it); more at once needs the multi-sequence engine (issue 30)")
    app = create_app(model, engine, options)
    # sse-starlette ends every event stream at a shutdown signal by default; ds4c drains them instead
    AppStatus.disable_automatic_graceful_drain()
    logging.getLogger("ds4c.server").setLevel(log_level.upper())
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout_s)
    _DrainingServer(config, app.state.scheduler).run()
