"""``ds4c serve``: OpenAI's API over HTTP (:func:`ds4c.server.serve`; docs/serving.md).

The options become one :func:`~ds4c.server.serve` call; what runs with what (the engine, prefill chunks, a
drafter's needs, the concurrency the engine offers, the key) is the API's rule, so a Python caller meets the same
one-line errors. Only the options' syntax is read here.
"""

from __future__ import annotations

import click

from ds4c import settings
from ds4c.cli.shell import (LANES_POLICY_OPTIONS, device_of, lanes_policy_options, model_path, prefill_chunks_option,
                            spec_width_option, split_options)
from ds4c.errors import Ds4cError

#: The defaults of the scheduler's limits, as ds4c.server.scheduler.SchedulerConfig and ServerOptions have them
#: (repeated here so that ``ds4c --help`` loads no FastAPI; tests/test_server.py checks they agree).
DEFAULTS = {"max_queue": 256, "queue_timeout_s": 60.0, "request_timeout_s": 600.0, "stream_buffer": 4096,
            "max_body_bytes": 8 << 20, "drain_timeout_s": 30.0, "port": 8000}


@click.command("serve")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 exposes the server beyond this machine).")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULTS["port"], show_default=True,
              help="0: a free port (printed).")
@click.option("--model-name", default=None, help="The model id clients name (default: the file's name without .gguf).")
@click.option("--api-key", default=None,
              help="Require 'Authorization: Bearer KEY' on every route but /health (default: $DS4C_API_KEY, which "
                   "keeps the key out of the process list; none when unset).")
@click.option("--lanes", type=click.IntRange(min=1), default=None,
              help="Sequences stepped together (continuous batching: on cuda the compiled step's decode lanes, on cpu "
                   "the reference's paged pool; prompts starting from cached prefixes; --draft on the "
                   "reference only). Default: one at a time.")
@lanes_policy_options
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="Sequences run at once (default: --lanes, else 1; the rest queue).")
@click.option("--max-queue", type=click.IntRange(min=0), default=DEFAULTS["max_queue"], show_default=True,
              help="Requests that may wait for a sequence; one more gets 429.")
@click.option("--queue-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULTS["queue_timeout_s"],
              show_default=True, help="Seconds a request may wait in the queue before 429.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True),
              default=DEFAULTS["request_timeout_s"], show_default=True,
              help="Seconds from arrival to the end of a request (then it is stopped: 408).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=DEFAULTS["drain_timeout_s"], show_default=True,
              help="On SIGTERM / Ctrl-C: seconds to let requests in flight finish.")
@click.option("--stream-buffer", type=click.IntRange(min=1), default=DEFAULTS["stream_buffer"], show_default=True,
              help="Text pieces buffered per request for a client that is slow to read; one more cancels it.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=DEFAULTS["max_body_bytes"], show_default=True,
              help="Larger request bodies get 413.")
@click.option("--max-ctx", type=click.IntRange(min=1), default=None,
              help="Positions a sequence may hold (prompt + reply). Default: the artifact's, else 4096.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--engine", type=click.Choice(["auto", "compiled", "reference"]), default="auto", show_default=True,
              help="auto: the compiled step (CUDA graphs) on cuda, the reference on cpu.")
@click.option("--artifact", type=click.Path(file_okay=False), default=None,
              help="Compiled engine: take the kernels from this `ds4c compile` artifact (nothing is compiled).")
@click.option("--draft", default=None, metavar="DRAFTER",
              help="Speculative decoding for every request (the spellings of `ds4c generate --draft`).")
@click.option("--spec-width", default="5", show_default=True, metavar="1..5|auto", help="With --draft: verify rows.")
@click.option("--prefill", "prefill", default=None, metavar="C,C,...",
              help="Compiled engine: prefill chunk graphs (as `ds4c generate --prefill`; default: an artifact's own).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads of the reference (1 is fastest on a machine shared with other work).")
@click.option("--dataflow", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Reference engine activations (as `ds4c generate --dataflow`).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@split_options
def command(file: str | None, host: str, port: int, model_name: str | None, api_key: str | None,
            lanes: int | None, lanes_prefill_chunk: int | None, lanes_prefill_every: int, lanes_prefill_rows: int,
            max_concurrency: int | None, max_queue: int, queue_timeout: float, request_timeout: float,
            drain_timeout: float, stream_buffer: int, max_body_bytes: int, max_ctx: int | None, device: str,
            engine: str, artifact: str | None, draft: str | None, spec_width: str, prefill: str | None,
            threads: int | None, dataflow: str, log_level: str, devices: str | None, layer_split: str | None) -> None:
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics; docs/serving.md). Runs until SIGTERM or Ctrl-C, then lets the requests in flight finish."""
    from ds4c.server import serve  # start-up speed: FastAPI and the model stack load only when the command runs

    chunks = prefill_chunks_option(prefill, "--prefill") if prefill is not None else None
    src = click.get_current_context().get_parameter_source
    policy = [o for o, p in LANES_POLICY_OPTIONS if src(p) is not click.core.ParameterSource.DEFAULT]
    if policy and lanes is None:
        raise Ds4cError(f"{', '.join(policy)}: applies only with --lanes N")
    if policy:
        from ds4c.batching import BatchConfig  # start-up speed: torch loads only when the command runs

        lanes = BatchConfig(max_lanes=lanes, prefill_chunk=lanes_prefill_chunk, prefill_every=lanes_prefill_every,
                            prefill_rows=lanes_prefill_rows)
    serve(model_path(file), host=host, port=port, max_concurrency=max_concurrency, lanes=lanes,
          api_key=api_key if api_key is not None else settings.api_key(), model_name=model_name,
          device=device_of(device, devices), engine=engine, artifact=artifact, max_ctx=max_ctx, threads=threads,
          dataflow=dataflow, devices=devices, layer_split=layer_split, prefill_chunks=chunks, draft=draft,
          spec_width=spec_width_option(spec_width), max_queue=max_queue, queue_timeout_s=queue_timeout,
          request_timeout_s=request_timeout, stream_buffer=stream_buffer, max_body_bytes=max_body_bytes,
          drain_timeout_s=drain_timeout, log_level=log_level)
