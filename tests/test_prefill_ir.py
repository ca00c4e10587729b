"""Prefill chunk graphs on the IR interpreter (issue: batched prefill, the CPU part): ``build_step(cfg, C,
prefill=True)`` is the step graph of C rows with the input ``n_valid`` (rows past it are padding: computed,
never kept) and a head on the last valid row. A prompt prefilled in chunks through it equals token-wise
decoding on the reference bit for bit (next-token logits and every state buffer: window ring, compressor
and indexer state, compressed rows), before and after the default pass pipeline, for prompts from 1 to 20x
the window, crossing every flush and several context buckets; the seed's bug (chunked prefill valid only
inside the SWA ring) would show at the first chunk longer than the window.

The tiny preset: window 16, CSA ratio 4, HCA ratio 16.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from ds4c.buckets import BucketSpec
from ds4c.cli import main
from ds4c.config import MAX_PREFILL_ROWS, preset
from ds4c.errors import StepError
from ds4c.ir import Interpreter, build_step, run_step
from ds4c.ir.interpreter import run_split_step
from ds4c.passes.manager import run_pipeline
from ds4c.reference import Reference

TINY = preset("tiny")
MAX_CTX = 512


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _states_equal(a, b) -> list[str]:
    """Names of the state buffers that differ (empty: bit-equal)."""
    bad = []
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        for name in ("ring", "comp", "idx_keys"):
            u, v = getattr(x, name), getattr(y, name)
            if u is not None and not torch.equal(u, v):
                bad.append(f"l{i}.{name}")
        for name in ("comp_state", "idx_state"):
            u, v = getattr(x, name), getattr(y, name)
            if u is not None and not (torch.equal(u.kv, v.kv) and torch.equal(u.score, v.score)):
                bad.append(f"l{i}.{name}")
    return bad


class _Chunked:
    """Prefill through chunk graphs of ``chunk`` rows; ``passes``: each chunk through the default pipeline's
    graph of the smallest context bucket holding its end (so a long prompt crosses buckets)."""

    def __init__(self, weights, chunk: int, passes: bool):
        self.w, self.chunk, self.passes = weights, chunk, passes
        self.buckets = BucketSpec.build(TINY, (1,), MAX_CTX)
        g = build_step(TINY, chunk, MAX_CTX, prefill=True)
        self.raw = Interpreter(g, weights)
        self.by_ctx = {c: Interpreter(run_pipeline(g, "default", context=c).graph, weights)
                       for c in self.buckets.contexts} if passes else {}

    def run(self, toks: list[int]) -> tuple[Reference, torch.Tensor]:
        ref = Reference(self.w, max_ctx=MAX_CTX)
        p, logits = 0, None
        while p < len(toks):
            n = min(self.chunk, len(toks) - p)
            ip = self.by_ctx[next(c for c in self.buckets.contexts if p + n <= c)] if self.passes else self.raw
            logits = run_step(ip, ref.state, toks[p:p + n], p)
            p += n
        return ref, logits.reshape(-1)


@pytest.mark.parametrize("chunk,passes", [(24, False), (64, True)], ids=["C24-raw", "C64-passes"])
def test_chunked_prefill_equals_tokenwise_decoding(tiny_weights, chunk: int, passes: bool) -> None:
    """Prompts of 1, 70 and 330 (20x the window; flushes of both ratios; buckets 64 to
    512) tokens through the passed graphs of 64 rows, 40 (two chunks longer than the window) through the raw
    graph of 24: next-token logits and every state buffer bit-equal to token-wise decoding. The last chunk is
    padded (n_valid < C) for every length here."""
    pf = _Chunked(tiny_weights, chunk, passes)
    lengths = (1, 70, 330) if passes else (40,)
    toks_all = _prompt(max(lengths), seed=330)
    tokenwise = Reference(tiny_weights, max_ctx=MAX_CTX)  # one token-wise run; the prompts are its prefixes
    at: dict[int, tuple] = {}
    for p, t in enumerate(toks_all):
        logits = tokenwise.decode(t, p)
        if p + 1 in lengths:
            at[p + 1] = (tokenwise.snapshot(), logits.reshape(-1))
    for n in lengths:
        toks = toks_all[:n]
        want_ref, want = Reference(tiny_weights, max_ctx=MAX_CTX), at[n][1]
        want_ref.restore(at[n][0])
        got_ref, got = pf.run(toks)
        assert got.shape == want.shape and torch.equal(got, want), f"{n} tokens: next-token logits differ"
        assert got_ref.state.pos == n
        assert not _states_equal(got_ref.state, want_ref.state), f"{n} tokens: state differs"
        # the state then decodes on: the next token after the prompt sees the same
        t = int(want.argmax())
        assert torch.equal(got_ref.decode(t, n), want_ref.decode(t, n))


def test_padded_rows_touch_no_state(tiny_weights) -> None:
    """3 tokens in a chunk graph of 8 (5 padded rows) == the same 3 tokens in a graph of exactly 3 rows: the
    padded rows leave ring, compressor, indexer and compressed rows alone, and the logits are row 2's."""
    toks = _prompt(40, seed=3)
    pre = Reference(tiny_weights, max_ctx=MAX_CTX)
    for p, t in enumerate(toks[:29]):  # 29..31 cross a ratio-4 flush (31) and the HCA flush at 31
        pre.decode(t, p)
    a, b = pre.snapshot(), pre.snapshot()
    la = run_step(Interpreter(build_step(TINY, 8, MAX_CTX, prefill=True), tiny_weights), a, toks[29:32], 29)
    lb = run_step(Interpreter(build_step(TINY, 3, MAX_CTX, prefill=True), tiny_weights), b, toks[29:32], 29)
    assert la.shape == (1, TINY.vocab_size) and torch.equal(la, lb)
    assert not _states_equal(a, b) and a.pos == b.pos == 32


def test_all_logits_are_every_rows(tiny_weights) -> None:
    """With ``all_logits`` the head reads every row: the valid rows' logits are token-wise decoding's."""
    toks = _prompt(12, seed=4)
    ref = Reference(tiny_weights, max_ctx=MAX_CTX)
    want = torch.cat([ref.decode(t, p).reshape(1, -1) for p, t in enumerate(toks)])
    g = build_step(TINY, 16, MAX_CTX, prefill=True, all_logits=True)
    got = run_step(Interpreter(g, tiny_weights), Reference(tiny_weights, max_ctx=MAX_CTX).state, toks, 0)
    assert got.shape == (16, TINY.vocab_size) and torch.equal(got[:12], want)


def test_prefill_through_a_layer_split(tiny_weights) -> None:
    """Shards' prefill chunk graphs (hc_out of all C rows crosses the boundary) == the unsplit chunk graph."""
    toks = _prompt(30, seed=5)
    whole = Interpreter(build_step(TINY, 32, MAX_CTX, prefill=True), tiny_weights)
    shards = [Interpreter(build_step(TINY, 32, MAX_CTX, layers=lr, prefill=True), tiny_weights)
              for lr in ((0, 2), (2, 6))]
    a, b = Reference(tiny_weights, max_ctx=MAX_CTX).state, Reference(tiny_weights, max_ctx=MAX_CTX).state
    la, lb = run_step(whole, a, toks, 0), run_split_step(shards, b, toks, 0)
    assert torch.equal(la, lb) and not _states_equal(a, b)


def test_bad_prefill_requests_are_one_line_errors(tiny_weights) -> None:
    for width in (0, MAX_PREFILL_ROWS + 1):
        with pytest.raises(StepError, match=f"prefill chunk width must be in 1..{MAX_PREFILL_ROWS}"):
            build_step(TINY, width, MAX_CTX, prefill=True)
    with pytest.raises(StepError, match="step width must be in 1..5"):
        build_step(TINY, 6, MAX_CTX)
    with pytest.raises(StepError, match="all_logits is a prefill graph option"):
        build_step(TINY, 2, MAX_CTX, all_logits=True)
    ip = Interpreter(build_step(TINY, 4, MAX_CTX, prefill=True), tiny_weights)
    st = Reference(tiny_weights, max_ctx=MAX_CTX).state
    with pytest.raises(StepError, match="prefill chunk graph is for 1..4 tokens, got 5"):
        run_step(ip, st, _prompt(5), 0)
    with pytest.raises(StepError, match="prefill chunk graph is for 1..4 tokens, got 0"):
        run_step(ip, st, [], 0)


def test_lowering_refuses_prefill_graphs_in_one_line() -> None:
    """A chunk graph lowers whole for sm_90 and gfx1151 (runtime/lower_prefill.py, tests/test_prefill_lower.py); for
    a target the grouped-experts family does not build (gfx1201), without a ``pending`` list the refusal is one line
    naming the first pending kernel and the family."""
    from ds4c.runtime.lower import lower_graph
    from ds4c.runtime.lowered import LoweringError
    from ds4c.runtime.targets import target

    g = run_pipeline(build_step(TINY, 64, 128, prefill=True), "default", context=128).graph
    assert lower_graph(g, TINY, target("sm_90")) and lower_graph(g, TINY, target("gfx1151"))
    with pytest.raises(LoweringError) as ei:
        lower_graph(g, TINY, target("gfx1201"))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("l0.moe_experts: ") and "grouped-experts family (moe_gemm)" in msg


def test_inspect_ir_prints_the_chunk_graph(tmp_path) -> None:
    env = {"DS4C_HOME": str(tmp_path)}
    r = CliRunner().invoke(main, ["inspect-ir", "--preset", "tiny", "--prefill", "64", "--max-ctx", "256",
                                  "--after", "fix_verify_width", "--layers", "-1"], env=env)
    assert r.exit_code == 0, r.output
    assert "prefill chunk of 64 rows" in r.output and "take_row" in r.output and "n_valid" in r.output
    r = CliRunner().invoke(main, ["inspect-ir", "--preset", "tiny", "--prefill", "8", "--width", "2"], env=env)
    assert r.exit_code == 2 and "not both" in r.output
    r = CliRunner().invoke(main, ["inspect-ir", "--preset", "tiny", "--prefill", "64", "--max-ctx", "16"], env=env)
    assert r.exit_code == 2 and "longer than the context (16)" in r.output
