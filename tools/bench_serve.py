"""Benchmark ``ds4c serve`` with concurrent streaming clients (the official ``openai`` client).

Starts ``ds4c serve MODEL --port 0`` (``--model-args`` for both the server and the baseline, ``--serve-args`` for
the server alone) and stops it with SIGTERM at the end, or drives a running server (``--url``). For each level of
``--concurrency`` C, C clients each send ``--requests`` streaming requests one after another (completions, or chat
with ``--chat``; greedy, ``ignore_eos``, ``--max-tokens`` new tokens each, usage included) after one warm-up
request, and the tool reports per level:

* **TTFT**: request sent to its first text chunk (queueing and prefill included), p50 / p95 / p99;
* **ITL**: the gaps between a request's text chunks (a chunk holds one token unless a UTF-8 character or a possible
  stop string spans several), p50 / p95 / p99;
* **per-request tokens/s**: (tokens - 1) / (last chunk - first chunk), the decode rate a client sees, p50 / p95
  (p95 here: the 5th percentile, the slow tail);
* **aggregate tokens/s**: all generated tokens of the level / the level's wall time.

``--baseline-generate`` (only when the tool started the server) then runs ``ds4c generate MODEL --json`` on the
same prompt and token count with ``--model-args``: the single-stream decode rate and prefill time without HTTP, on
the same device in the same run. ``--json FILE`` writes every number as one record.

Examples::

    python tools/bench_serve.py tiny.gguf --concurrency 1,2 --requests 2 --max-tokens 8 --model-args "--threads 1"
    python tools/bench_serve.py flash-l4.gguf --model-args "--device cuda --artifact build/" \\
        --concurrency 1,4,8,16 --max-tokens 128 --baseline-generate --json serve.json
    python tools/bench_serve.py --url http://127.0.0.1:8000 --api-key KEY --chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import openai

from ds4c.tempfiles import write_text_atomic

DEFAULT_PROMPT = "The quick brown fox"


@dataclass
class Request:
    """One streamed request as a client saw it (seconds from ``sent``)."""

    ttft: float
    total: float
    tokens: int
    prompt_tokens: int
    gaps: list[float] = field(default_factory=list)

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first per second of streaming (None with fewer than 2 tokens)."""
        decode = self.total - self.ttft
        return (self.tokens - 1) / decode if self.tokens > 1 and decode > 0 else None


def pct(values: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    """Percentiles ``qs`` of ``values`` (linear interpolation; None when empty)."""
    return {f"p{q}": (float(np.percentile(values, q)) if values else None) for q in qs}


class Server:
    """``ds4c serve MODEL --port 0 ARGS`` in a child process; ``url`` once it listens."""

    def __init__(self, model: str | None, args: list[str], timeout_s: float):
        cmd = [sys.executable, "-m", "ds4c.cli", "serve", *([model] if model else []), "--port", "0",
               "--log-level", "warning", *args]
        print("starting:", shlex.join(cmd), file=sys.stderr)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.url = ""
        listening = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    listening.set()
            listening.set()

        threading.Thread(target=read, daemon=True).start()
        listening.wait(timeout_s)
        if not self.url:
            self.stop()
            sys.exit("bench_serve: the server did not start:\n" + "".join(self.log[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, chat: bool) -> Request:
    """One greedy streaming request of ``max_tokens`` new tokens, timed."""
    extra = {"temperature": 0, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
             "extra_body": {"ignore_eos": True}}
    t0 = time.perf_counter()
    if chat:
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                      **extra)
    else:
        stream = await client.completions.create(model=model, prompt=prompt, **extra)
    first, last, gaps, usage = None, None, [], None
    async for ch in stream:
        usage = ch.usage or usage
        if not ch.choices:
            continue
        if chat:
            d = ch.choices[0].delta
            text = d.content or (d.model_extra or {}).get("reasoning_content") or ""
        else:
            text = ch.choices[0].text
        if not text:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
    end = time.perf_counter()
    if usage is None or first is None:
        raise RuntimeError("the server sent no text or no usage chunk")
    return Request(ttft=first - t0, total=last - t0 if last else end - t0, tokens=usage.completion_tokens,
                   prompt_tokens=usage.prompt_tokens, gaps=gaps)


async def level(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, chat: bool,
                concurrency: int, requests: int) -> dict:
    """``concurrency`` clients with ``requests`` requests each; the level's summary."""

    async def a_client() -> list[Request]:
        return [await one_request(client, model, prompt, max_tokens, chat) for _ in range(requests)]

    t0 = time.perf_counter()
    done = [r for rs in await asyncio.gather(*(a_client() for _ in range(concurrency))) for r in rs]
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in done)
    tps = [t for r in done if (t := r.decode_tps) is not None]
    return {"concurrency": concurrency, "requests": len(done), "wall_s": wall, "tokens": tokens,
            "prompt_tokens": done[0].prompt_tokens, "aggregate_tokens_per_s": tokens / wall,
            "ttft_s": pct([r.ttft for r in done], (50, 95, 99)),
            "itl_s": pct([g for r in done for g in r.gaps], (50, 95, 99)),
            "request_tokens_per_s": pct(tps, (50, 5))}


def baseline_generate(model: str, args: list[str], prompt: str, max_tokens: int, chat: bool) -> dict:
    """``ds4c generate --json`` on the same prompt: the single-stream numbers without the server."""
    how = ["--chat", prompt] if chat else ["--prompt", prompt]
    cmd = [sys.executable, "-m", "ds4c.cli", "generate", model, *how, "--max-new-tokens", str(max_tokens),
           "--ignore-eos", "--json", *args]
    print("baseline:", shlex.join(cmd), file=sys.stderr)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("bench_serve: ds4c generate failed:\n" + out.stderr[-2000:])
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: rec.get(k) for k in ("engine", "device", "load_s", "prefill_s", "decode_tokens_per_s",
                                    "prefill_tokens_per_s")} | {"tokens": len(rec.get("tokens", ()))}


def print_level(r: dict) -> None:
    def ms(d: dict) -> str:
        return " / ".join("-" if v is None else f"{v * 1e3:.1f}" for v in d.values())

    tps = " / ".join("-" if v is None else f"{v:.2f}" for v in r["request_tokens_per_s"].values())
    print(f"{r['concurrency']:>4d} {r['requests']:>5d} {r['aggregate_tokens_per_s']:>10.2f} "
          f"{ms(r['ttft_s']):>26s} {ms(r['itl_s']):>24s} {tps:>16s}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="the model ds4c serve opens (a GGUF, synthetic:..., none: the default)")
    ap.add_argument("--url", help="drive this running server instead (http://HOST:PORT)")
    ap.add_argument("--model-name", help="the model id to request (default: the server's first in /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("DS4C_API_KEY") or "none",
                    help="the server's key (default: $DS4C_API_KEY)")
    ap.add_argument("--concurrency", default="1,4,8,16", help="comma-separated client counts (default 1,4,8,16)")
    ap.add_argument("--requests", type=int, default=4, help="requests per client per level (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the prompt (default {DEFAULT_PROMPT!r})")
    ap.add_argument("--chat", action="store_true", help="chat completions (the prompt as a user message)")
    ap.add_argument("--model-args", default="", help="options for ds4c serve and the baseline (--device cuda ...)")
    ap.add_argument("--serve-args", default="", help="options for ds4c serve alone (--max-queue ...)")
    ap.add_argument("--baseline-generate", action="store_true",
                    help="then run ds4c generate --json single-stream on the same prompt (needs MODEL, not --url)")
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds to wait for the server (default 1800)")
    ap.add_argument("--json", dest="json_out", help="write the results as one JSON record to this file")
    a = ap.parse_args(argv)
    try:
        levels = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated ints, found {a.concurrency!r}")
    if any(c < 1 for c in levels) or a.requests < 1 or a.max_tokens < 1:
        ap.error("--concurrency levels, --requests and --max-tokens must be >= 1")
    if a.url and a.baseline_generate:
        ap.error("--baseline-generate runs the model here: give MODEL, not --url")
    model_args, serve_args = shlex.split(a.model_args), shlex.split(a.serve_args)

    server = None if a.url else Server(a.model, model_args + serve_args, a.start_timeout)
    url = a.url or server.url
    results: list[dict] = []
    try:
        async def run() -> str:
            client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=a.api_key, max_retries=0,
                                        timeout=3600)
            name = a.model_name or (await client.models.list()).data[0].id
            await one_request(client, name, a.prompt, min(a.max_tokens, 4), a.chat)  # warm-up
            print(f"{url} {'chat' if a.chat else 'completions'} ({name}), {a.max_tokens} new tokens per request, "
                  f"{a.requests} per client; times in ms (p50 / p95 / p99), tokens/s per request p50 / p5")
            print(f"{'C':>4s} {'reqs':>5s} {'agg tok/s':>10s} {'TTFT ms':>26s} {'ITL ms':>24s} {'req tok/s':>16s}")
            for c in levels:
                results.append(await level(client, name, a.prompt, a.max_tokens, a.chat, c, a.requests))
                print_level(results[-1])
            await client.close()
            return name

        name = asyncio.run(run())
    finally:
        if server is not None:
            server.stop()
    rec = {"url": a.url, "model": a.model, "model_name": name, "endpoint": "chat" if a.chat else "completions",
           "max_tokens": a.max_tokens, "requests_per_client": a.requests, "prompt": a.prompt,
           "model_args": model_args, "serve_args": serve_args, "levels": results}
    if a.baseline_generate:
        base = baseline_generate(a.model, model_args, a.prompt, a.max_tokens, a.chat)
        rec["generate_baseline"] = base
        print(f"ds4c generate single-stream ({base['engine']} on {base['device']}): decode "
              f"{base['decode_tokens_per_s'] or 0:.2f} tokens/s, prefill {base['prefill_s'] * 1e3:.1f} ms")
    if a.json_out:
        write_text_atomic(a.json_out, json.dumps(rec, indent=1))
        print(f"wrote {a.json_out}", file=sys.stderr)


if __name__ == "__main__":
    main()
