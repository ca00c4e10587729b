"""``ds4c bench --prefill LENGTHS``: prompt ingestion as a user meets it (docs/prefill.md), in one run.

For each prompt length L (random ids, a fresh sequence each time):

* **chunks**: ``CompiledStep.prefill`` through the prefill chunk graphs (``--prefill-chunks``, default 256 and
  2048; docs/prefill.md), then the first token (the argmax of the last row's logits, read on the host): the time
  to first token (TTFT) and L / prefill seconds;
* **verify**: the same prompt as verify steps of 5 rows on the same compiled step (today's path, the baseline);
* **compute roofline**: the prompt's FLOPs (:func:`prefill_flops`: every weight product of every token, the
  routed experts at k of E, the head once; attention over each row's window and compressed rows; the
  indexer's scores) over the card's dense GEMM rate measured in the same run (:func:`gemm_rates`: torch's bf16
  matmul and, where torch has it, its fp8 e4m3 ``_scaled_mm``), as a time and as the fraction ours reaches;
* **llama.cpp**: ``llama-bench -p L -n 0`` on the same file (``--llama-bench PATH``), its pp rate.

On the CPU (``--device cpu``) only the verify column runs (the reference; no chunk graphs, no card rates), so the
command and its report are testable without a GPU. Times are wall seconds around a synchronised call, median of
``repeats`` (the verify baseline once: at 32K it is minutes). Nothing imports this module but the CLI.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ds4c.bench import check_llama_bench, llama_records, record_rate
from ds4c.buckets import DEFAULT_PREFILL_CHUNKS
from ds4c.config import Ds4Config
from ds4c.engine_protocol import ChunkedPrefill, Engine, GraphHost
from ds4c.errors import Ds4cError
from ds4c.gguf_file import ModelFile

#: the chunk sizes ``ds4c bench --prefill`` compiles when ``--prefill-chunks`` is not given
DEFAULT_CHUNKS = DEFAULT_PREFILL_CHUNKS
_LOOKUPS = ("token_embd.weight", "_ape.weight", "tid2eid.weight")  # tables read by index or added: no products


def prefill_flops(cfg: Ds4Config, length: int) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of prefilling ``length`` tokens from position 0, by part (spec sections 5-6).

    * ``weights``: per token, every 2-D weight it multiplies (projections, HC mixes, router, compressor and
      indexer projections, the shared expert) and ``n_active / n_experts`` of the routed experts' 3-D banks;
      lookups (the embedding, the compressors' position tables, the hash router's table) count nothing;
    * ``head``: the output projection, once (only the last row's logits are made);
    * ``attention``: per layer and row at position p, ``4 H hd`` per attended entry, the entries being its
      window ``min(p + 1, window)`` plus its compressed rows (CSA ``min(index_topk, (p + 1) // 4)``, HCA
      ``(p + 1) // ratio``);
    * ``indexer``: per CSA layer and row, ``2 index_heads index_head_dim`` per visible compressed key.

    Returns ``{"weights", "head", "attention", "indexer", "total"}`` in FLOPs (floats).
    """
    from ds4c.tensors import tensor_specs

    per_token = 0.0
    head = 0.0
    for s in tensor_specs(cfg):
        if s.name.endswith(_LOOKUPS):
            continue
        if s.name == "output.weight":
            head = 2.0 * s.shape[0] * s.shape[1]
        elif s.name.startswith("blk.") and len(s.shape) == 3:
            per_token += 2.0 * s.shape[1] * s.shape[2] * cfg.n_active_experts
        elif s.name.startswith("blk.") and len(s.shape) == 2:
            per_token += 2.0 * s.shape[0] * s.shape[1]
        elif s.name.startswith("output_hc") and len(s.shape) == 2:
            per_token += 2.0 * s.shape[0] * s.shape[1]
    p1 = np.arange(1, length + 1, dtype=np.float64)  # p + 1 for p = 0 .. length - 1
    att = idx = 0.0
    for i in range(cfg.n_layers):
        r = cfg.ratio(i)
        entries = np.minimum(p1, cfg.window)
        if r == 4:
            entries = entries + np.minimum(cfg.index_topk, np.floor(p1 / 4))
            idx += 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(np.floor(p1 / 4).sum())
        elif r:
            entries = entries + np.floor(p1 / r)
        att += 4.0 * cfg.n_heads * cfg.head_dim * float(entries.sum())
    weights = per_token * length
    return {"weights": weights, "head": head, "attention": att, "indexer": idx,
            "total": weights + head + att + idx}


def gemm_rates(device: torch.device, n: int = 8192, repeats: int = 10) -> dict[str, float | None]:
    """The card's dense GEMM rate in TFLOP/s, measured now with torch: ``bf16`` (an ``n x n x n`` matmul) and
    ``fp8`` (e4m3 ``torch._scaled_mm`` with unit scales; None where torch or the card has none). CUDA only."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def rate(fn: Callable[[], Any]) -> float:
        fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        return 2.0 * n ** 3 / statistics.median(times) / 1e12

    out: dict[str, float | None] = {"bf16": rate(lambda: a @ b), "fp8": None}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().t().to(torch.float8_e4m3fn)
        one = torch.ones((), device=device, dtype=torch.float32)
        out["fp8"] = rate(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except (AttributeError, RuntimeError, TypeError):
        pass
    del a, b
    return out


def llama_pp(exe: str, model: Any, lengths: tuple[int, ...], say: Callable[[str], None]) -> dict[str, Any]:
    """llama.cpp's prompt processing on ``model``: ``llama-bench -p L -n 0 -r 2 -ngl 99 -o json`` per length.
    Returns ``{"pp_tok_s": {L: tokens/s}, "errors": {L: one line}}`` (a failure is recorded, never raised)."""
    out: dict[str, Any] = {"pp_tok_s": {}, "errors": {}}
    for n in lengths:
        try:
            recs = [x for x in llama_records(exe, model, ["-p", str(n), "-n", "0", "-r", "2", "-ngl", "99", "-o",
                                                          "json"]) if x.get("n_prompt") == n and not x.get("n_gen")]
            if not recs:
                raise ValueError(f"expected a test record with n_prompt {n} and n_gen 0, found none")
            out["pp_tok_s"][n] = record_rate(recs[0])
            say(f"llama.cpp pp{n}: {out['pp_tok_s'][n]:.0f} tokens/s")
        except ValueError as e:
            out["errors"][n] = str(e).splitlines()[0]
            say(f"llama.cpp pp{n}: {out['errors'][n]}")
    return out


@dataclass
class PrefillRow:
    """One prompt length. Seconds; tokens/s; FLOPs; None = not run (see ``notes``)."""

    length: int
    flops: dict[str, float]
    chunks_s: float | None = None
    chunks_ttft_s: float | None = None
    verify_s: float | None = None
    verify_ttft_s: float | None = None
    llama_tok_s: float | None = None
    roofline_bf16_s: float | None = None
    roofline_fp8_s: float | None = None
    logits_rel_err: float | None = None
    argmax_agrees: bool | None = None
    notes: list[str] = field(default_factory=list)

    def rate(self, seconds: float | None) -> float | None:
        return self.length / seconds if seconds else None


@dataclass
class PrefillReport:
    model: str
    device: str
    chunks: tuple[int, ...]
    gemm_tflops: dict[str, float | None]
    rows: list[PrefillRow]
    start_s: float
    llama: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r, row in zip(d["rows"], self.rows):
            r.update(chunks_tok_s=row.rate(row.chunks_s), verify_tok_s=row.rate(row.verify_s),
                     achieved_tflops=row.flops["total"] / row.chunks_s / 1e12 if row.chunks_s else None)
        return d


def _timed(stepper: Engine, prompt: list[int], chunks: tuple[int, ...] | None) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, TTFT seconds, the last token's fp32 logits ``[vocab]`` on the host) of one fresh prompt:
    ``chunks`` None = verify steps of 5 rows (a stepper without chunk graphs), else the compiled step's prefill
    with those chunks."""
    cuda = isinstance(stepper, GraphHost)  # the compiled step (on its CUDA device ``dev``)
    stepper.reset()
    if cuda:
        torch.cuda.synchronize(stepper.dev)
    t0 = time.perf_counter()
    if isinstance(stepper, ChunkedPrefill):
        logits = stepper.prefill(prompt, 0, chunks=chunks or ())
    else:
        for s in range(0, len(prompt), 5):
            logits = stepper.verify(prompt[s:s + 5], s)
    if cuda:
        torch.cuda.synchronize(stepper.dev)
    t1 = time.perf_counter()
    int(logits[-1].argmax())  # the first token, on the host
    ttft = time.perf_counter() - t0
    return t1 - t0, ttft, logits[-1].float().cpu()


def run_prefill_bench(mf: ModelFile, lengths: tuple[int, ...], device: str = "cuda",
                      chunks: tuple[int, ...] = DEFAULT_CHUNKS, llama_bench: str | None = None, repeats: int = 3,
                      baseline: bool = True, seed: int = 0, say: Callable[[str], None] = print) -> PrefillReport:
    """Run the prefill benchmark (module docstring).

    Args:
        mf: the model file; lengths: prompt lengths (each >= 1; the step serves max(lengths) + 1 positions).
        device: ``cuda`` (compiled step with chunk graphs) or ``cpu`` (the reference's verify steps only).
        chunks: the chunk sizes to compile (:func:`~ds4c.buckets.check_prefill_chunks`).
        llama_bench: llama.cpp's ``llama-bench``: its pp rate at each length on the same file.
        repeats: timed prompts per length through the chunks (median); the verify baseline runs once.
        baseline: also time the verify-step path (False: skipped, e.g. at 32K on the 43-layer model).

    Raises:
        Ds4cError: lengths that are not distinct or < 1 or past the model's context length; ``baseline=False``
            on the cpu (nothing left to measure); a ``llama_bench`` that :func:`~ds4c.bench.check_llama_bench`
            refuses; what opening the engine raises.
    """
    from ds4c.buckets import check_prefill_chunks
    from ds4c.engine import open_engine

    cfg = mf.config
    lengths = tuple(lengths)
    if not lengths or min(lengths) < 1 or len(set(lengths)) != len(lengths):
        what = "a duplicate in " if lengths and len(set(lengths)) != len(lengths) else ""
        raise Ds4cError(f"--prefill: expected distinct prompt lengths >= 1 (tokens), found {what}{list(lengths)}")
    if any(n + 1 > cfg.max_position for n in lengths):
        raise Ds4cError(f"--prefill: expected prompt lengths in 1..{cfg.max_position - 1}, found {list(lengths)}")
    cuda = device == "cuda"
    if not cuda and not baseline:
        raise Ds4cError("--no-prefill-baseline on the cpu leaves nothing to measure (the chunk graphs need "
                        "--device cuda)")
    llama_bench = check_llama_bench(mf, llama_bench)
    chunks = check_prefill_chunks(chunks) if cuda else ()
    t0 = time.perf_counter()
    stepper = open_engine(mf, device=device, max_ctx=max(lengths) + 1, prefill_chunks=chunks)
    start_s = time.perf_counter() - t0
    rates = gemm_rates(stepper.dev) if cuda else {"bf16": None, "fp8": None}
    if cuda:
        say(f"dense GEMM rate of this card (torch): bf16 {rates['bf16']:.0f} TFLOP/s, fp8 "
            + (f"{rates['fp8']:.0f} TFLOP/s" if rates["fp8"] else "not available"))
    llama = llama_pp(llama_bench, mf.path, lengths, say) if llama_bench else {}
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        row = PrefillRow(n, prefill_flops(cfg, n))
        for kind, tf in (("bf16", rates["bf16"]), ("fp8", rates["fp8"])):
            if tf:
                setattr(row, f"roofline_{kind}_s", row.flops["total"] / (tf * 1e12))
        if cuda:
            runs = [_timed(stepper, prompt, chunks) for _ in range(repeats)]
            row.chunks_s = statistics.median(r[0] for r in runs)
            row.chunks_ttft_s = statistics.median(r[1] for r in runs)
        else:
            row.notes.append("chunk graphs not run: need the compiled engine (--device cuda)")
        if baseline:
            row.verify_s, row.verify_ttft_s, want = _timed(stepper, prompt, None)
            if cuda:  # the chunk graphs' next-token logits against the verify steps' (the same kernels' noise)
                got = runs[-1][2]
                row.logits_rel_err = float((got - want).norm() / want.norm().clamp_min(1e-30))
                row.argmax_agrees = int(got.argmax()) == int(want.argmax())
        row.llama_tok_s = llama.get("pp_tok_s", {}).get(n)
        rows.append(row)
        say(format_prefill_row(row))
    return PrefillReport(cfg.name, device if not cuda else torch.cuda.get_device_name(stepper.dev), chunks,
                         rates, rows, start_s, llama)


def _f(x: float | None, spec: str) -> str:
    """``x`` in ``spec``; None as "-" right-aligned to the spec's width."""
    if x is not None:
        return format(x, spec)
    width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0)
    return "-".rjust(width)


def format_prefill_row(r: PrefillRow) -> str:
    return (f"prefill {r.length}: chunks {_f(r.rate(r.chunks_s), '.0f')} tokens/s (TTFT "
            f"{_f(None if r.chunks_ttft_s is None else r.chunks_ttft_s * 1e3, '.1f')} ms), verify steps "
            f"{_f(r.rate(r.verify_s), '.0f')} tokens/s, llama.cpp {_f(r.llama_tok_s, '.0f')} tokens/s, "
            f"{r.flops['total'] / 1e12:.2f} TFLOP"
            + (f"; chunks vs verify logits rel err {r.logits_rel_err:.2e}, argmax "
               f"{'agrees' if r.argmax_agrees else 'DIFFERS'}" if r.logits_rel_err is not None else "")
            + "".join(f"; {m}" for m in r.notes))


def format_prefill_report(rep: PrefillReport) -> str:
    """The table: per length tokens/s of ours (chunks, verify steps) and llama.cpp, TTFT, and the compute
    roofline's time and the fraction of it ours reaches (bf16 / fp8 card rates)."""
    lines = [f"model {rep.model} on {rep.device}; prefill chunks {list(rep.chunks) or '-'}; dense GEMM rate bf16 "
             f"{_f(rep.gemm_tflops.get('bf16'), '.0f')} / fp8 {_f(rep.gemm_tflops.get('fp8'), '.0f')} TFLOP/s; "
             f"start {rep.start_s:.1f} s",
             f"{'tokens':>7} {'chunks tok/s':>12} {'TTFT ms':>8} {'verify tok/s':>12} {'llama tok/s':>11} "
             f"{'ours/llama':>10} {'TFLOP':>7} {'roof bf16 ms':>12} {'roof/ours':>9} {'roof fp8 ms':>11} "
             f"{'roof/ours':>9}"]
    for r in rep.rows:
        ours = r.rate(r.chunks_s) or r.rate(r.verify_s)
        lines.append(
            f"{r.length:7d} {_f(r.rate(r.chunks_s), '12.0f')} "
            f"{_f(None if r.chunks_ttft_s is None else r.chunks_ttft_s * 1e3, '8.1f')} "
            f"{_f(r.rate(r.verify_s), '12.0f')} {_f(r.llama_tok_s, '11.0f')} "
            f"{_f(ours / r.llama_tok_s if ours and r.llama_tok_s else None, '10.2f')} {r.flops['total'] / 1e12:7.2f} "
            f"{_f(None if r.roofline_bf16_s is None else r.roofline_bf16_s * 1e3, '12.1f')} "
            f"{_f(r.roofline_bf16_s / r.chunks_s if r.roofline_bf16_s and r.chunks_s else None, '9.2f')} "
            f"{_f(None if r.roofline_fp8_s is None else r.roofline_fp8_s * 1e3, '11.1f')} "
            f"{_f(r.roofline_fp8_s / r.chunks_s if r.roofline_fp8_s and r.chunks_s else None, '9.2f')}")
    for n, e in rep.llama.get("errors", {}).items():
        lines.append(f"llama.cpp pp{n} not measured: {e}")
    return "\n".join(lines)
