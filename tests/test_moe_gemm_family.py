"""The grouped experts GEMM family (runtime/families/moe_gemm.py, templates/moe_gemm/moe_gemm.cu.j2), on the CPU:

* the torch routing tables (``routing_tables``): grouped by expert, rows ascending, tiles of <= 64 pairs, the
  tile-slot bound ``tile_slots`` for random and adversarial routings;
* the whole call (route, actq_x, up, actq_h, down, combine) emulated on CPU fibers (tests/emulators/moe_gemm_emu.py,
  ``mma.sync`` from its fragment layouts), every workspace and the output poisoned: the device routing tables
  equal the torch ones exactly, every ``hbuf`` / ``ybuf`` row and every output element written (finite), the
  unused tile slots have count 0, ``hbuf`` against ``reference_h``, ``out`` against ``reference``
  (``ds4c.reference.blocks.routed_sum`` per row) and bit-exactly against the ordered fp32 sum of ``ybuf``;
  rows routed unevenly (one expert picked by ~90% of the rows: two tiles; one expert picked by none);
* the 128-wide tile (``bn`` 128, 256 threads): every written buffer bit-identical to the 64-wide kernel's on the
  same inputs (MXFP4 uneven, Q8_0, Q3_K cp.async up + Q4_K down, dense), and against the reference as above;
  ``bn`` 0 / 64 render the same sources; ``DS4C_PREFILL_MOE_BN=128`` reaches the prefill lowering's launches;
* device compiles for sm_90 (nvcc: no spills, no stack), skipped with the reason when nvcc is missing;
* the HIP body (MFMA on gfx942, WMMA on gfx1151) emulated from the AMD ISA's fragment layouts, compiled with clang;
* RenderError (one line) for sm_80, gfx1201, what HIP does not build, unsupported formats and bad sizes; the GPU
  check's cases build on the CPU.

Noise floor (emulation, D = 256, I = 128, E = 16, k = 3; and D = 384, I = 256, E = 8, k = 2): kernel and reference have the same products (codes,
scales and e4m3 values exact in f16 / fp32) and differ only in fp32 summation order inside each projection.
MXFP4 x e4m3 products and their 32-block sums are exact in fp32 here (a few significant bits each, power-of-two
scales, one 128-block of h per down row at I = 128), so the MXFP4 runs are bit-identical to the reference (out
rel-L2 0); with two 128-blocks of h per down row (I = 256) the fp32 sum of the two scaled partials can round
differently (1 of 19712 outputs seen, rel-L2 6e-10), so there the bound below applies. Q8_0's
fp16 block scales are not powers of two, so its per-block products round: ~1e-7 relative differences flip the
bf16 rounding of about 1 in 10^4 h elements (observed 3-4 of 29568) and of a few y elements. A flipped y element
moves one output by one bf16 ulp of y: out vs ``reference_down`` (the reference's down phase + combine on the
kernel's own h) rel-L2 ~9e-7, worst row 8e-6. A flipped h element moves all D outputs of its pair by
ulp(h) * W2[:, i], and some of those y roundings flip in turn: out vs the full reference rel-L2 up to 1.1e-4
(worst row 1e-3) when an h flip happens, ~1e-6 when none does; that chained floor is inherent to the bf16
intermediates (the reference's own choice of fp32 order would move it the same way). Tolerances (derived in tests/numerics.py; no fixed constant below bf16's floor, which made the verdict depend on
the CPU's fp32 summation order): vs ``reference_down`` per element ``|out - ref| <= 2^-7 * sum_j |ybuf_j| + 1e-6``
(one bf16 ulp of each expert output) and at most ``flip_fraction_bound(I)`` of the elements differing; vs
``reference`` bit for bit with no h flip in an MXFP4 call (its products and sums are exact), else relative L2
``<= 2 * 2^-7`` (two chained bf16 roundings, h and y, each at most one ulp per element; observed up to 1.1e-4);
h: at most 1% of the elements differing, each within ``_h_flip_bound`` (g and u each one bf16 ulp plus the fp32
error of their K-long sums apart, carried through silu and the product: a few ulps of h where g and u are not
near zero; observed 1-2 ulps, and ~12% relative on an h ~2e-10 whose g and u sums cancel, in a Q3_K case).
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import pytest
import torch
from numerics import BF16_ULP, assert_same_roundings, flip_fraction_bound

from ds4c.runtime.families import moe_gemm as MG
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from emulators import moe_gemm_emu as EMU
from kernel_compile import assert_no_spills, compile_kernel, compiler_missing


TINY = dict(hidden=256, inter=128, k=3, n_experts=16)


def _uneven_ids(C: int, k: int, E: int, g: torch.Generator, hot: int = 5, cold: int = 9) -> torch.Tensor:
    """ids int64 [C, k]: expert ``hot`` in every row but those with r % 11 == 3 (> 64 rows at C >= 77: two
    tiles), ``cold`` in none, the other slots random distinct, slots shuffled per row."""
    rows = []
    for r in range(C):
        pick = [hot] if r % 11 != 3 else []
        pool = [e for e in torch.randperm(E, generator=g).tolist() if e not in (hot, cold) and e not in pick]
        row = torch.tensor(pick + pool[:k - len(pick)])
        rows.append(row[torch.randperm(k, generator=g)])
    return torch.stack(rows).to(torch.int64)


# ----------------------------------------------------------------------------------------- routing tables
@pytest.mark.parametrize("C,E,k,skew", [(37, 16, 3, False), (200, 16, 6, True), (512, 256, 6, False)])
def test_routing_tables(C: int, E: int, k: int, skew: bool) -> None:
    spec = MG.MoeGemmSpec(rows=C, hidden=128, inter=128, k=k, n_experts=E)
    ids, _ = MG.random_routing(spec, torch.Generator().manual_seed(C), skew)
    perm, tiles = MG.routing_tables(spec, ids)
    flat = ids.reshape(-1)
    assert sorted(perm.tolist()) == list(range(C * k))
    ex = flat[perm.long()]
    assert bool((ex[1:] >= ex[:-1]).all())  # grouped by ascending expert
    same = ex[1:] == ex[:-1]
    assert bool((perm[1:][same] > perm[:-1][same]).all())  # rows ascending inside an expert
    used = tiles[tiles[:, 2] > 0]
    assert int(used[:, 2].sum()) == C * k and int(used[:, 2].max()) <= MG.TM
    assert tiles.shape[0] == MG.tile_slots(spec) and bool((tiles[len(used):] == 0).all())
    for e, p0, n, _ in used.tolist():
        assert bool((ex[p0:p0 + n] == e).all())


def test_tile_slots_bound_is_reached() -> None:
    """The worst case: every expert's count is 1 mod TM (all last tiles hold one pair)."""
    E, k = 8, 2
    C = (MG.TM + 1) * E // k  # 260 rows: each expert 65 pairs
    spec = MG.MoeGemmSpec(rows=C, hidden=128, inter=128, k=k, n_experts=E)
    ids = torch.tensor([[(2 * r) % E, (2 * r + 1) % E] for r in range(C)], dtype=torch.int64)
    _, tiles = MG.routing_tables(spec, ids)
    assert int((tiles[:, 2] > 0).sum()) == 2 * E <= MG.tile_slots(spec)


def _h_flip_bound(spec: MG.MoeGemmSpec, inp: dict, diff: torch.Tensor, hr: torch.Tensor) -> torch.Tensor:
    """The largest |kernel h - reference h| each differing ``hbuf`` element (``diff``) may show. g and u are bf16
    roundings of fp32 sums taken in another order: each may differ by one bf16 ulp (2^-7 |g|) plus the fp32
    summation error of a K-long sum (K 2^-24 sum_i |w_i x_i|, which dominates where the sum cancels to near zero).
    h = weight * silu(min(g, L)) * u moves by |weight| (|silu'(g) u| dg + |silu(g)| du), and its own rounding by
    one more ulp (2^-7 |h|)."""
    from ds4c.reference import primitives as P
    from ds4c.runtime.families.experts import dequantize_weight

    perm, _ = MG.routing_tables(spec, inp["ids"])
    flat, wts = inp["ids"].reshape(-1), inp["weights"].reshape(-1)
    K, out, ws = spec.hidden, [], {}
    for (p, col), h in zip(diff.nonzero().tolist(), hr[diff].tolist()):
        pair = int(perm[p])
        e, row = int(flat[pair]), pair // spec.k
        x = inp["x"][row:row + 1].to(torch.bfloat16)
        if e not in ws:
            ws[e] = [dequantize_weight(spec.fmt, w, spec.inter, spec.hidden, e) for w in (inp["w1"], inp["w3"])]
        gu = []
        for wm in ws[e]:
            wr = wm[col]
            v = float(P.linear_q(x, wr[None], spec.act_quant)[0, 0])
            gu.append((v, 2.0 ** -7 * abs(v) + K * 2.0 ** -24 * float((wr * x[0].float()).abs().sum()) * 2))
        (g, dg), (u, du) = gu
        gc = min(g, spec.limit)
        sig = 1.0 / (1.0 + torch.exp(torch.tensor(-gc)).item())
        silu, dsilu = gc * sig, sig * (1.0 + gc * (1.0 - sig))
        out.append(abs(float(wts[pair])) * (abs(dsilu * u) * dg + abs(silu) * du) + 2.0 ** -7 * abs(h))
    return torch.tensor(out)


# ----------------------------------------------------------------------------------------------- emulation
SMALL = dict(hidden=384, inter=256, k=2, n_experts=8)  # two K steps in the down phase, three in up
#: K-quant rows are whole pairs of 256-value super-blocks: 4 K steps each way, both halves of both super-blocks (Q3_K
#: / Q6_K: the second super-block's bytes 2 past a word boundary)
KQ = dict(hidden=512, inter=512, k=2, n_experts=4)  # (the tile logic is the other cases'; these are the decodes)
EMU_CASES = [  # (C, fmt, down_fmt, routing, sizes)
    (77, "mxfp4", "mxfp4", "uneven", TINY),
    (77, "q8_0", "q8_0", "uneven", TINY),
    (37, "mxfp4", "q8_0", "skew", TINY),
    (70, "q8_0", "mxfp4", "skew", SMALL),
    # every K-quant and IQ4_XS, each once: with a min term per 16 (Q2_K) or per 32 values (Q4_K, Q5_K), without
    # (Q3_K, Q6_K, IQ4_XS); the 4-byte staged ones (Q2_K, Q3_K, Q6_K) through cp.async
    (33, "q4_k", "q2_k", "skew", KQ),
    (33, "q5_k", "q6_k", "skew", KQ),
    (33, "iq4_xs", "q3_k", "skew", KQ),
]


@pytest.mark.parametrize("C,fmt,down_fmt,routing,sizes", EMU_CASES)
def test_emulated_call(C: int, fmt: str, down_fmt: str, routing: str, sizes: dict) -> None:

    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    spec = MG.MoeGemmSpec(rows=C, fmt=fmt, down_fmt=down_fmt, **sizes)
    inp = _emu_inputs(spec, routing)
    with tempfile.TemporaryDirectory() as d:
        got = EMU.run(spec, inp, Path(d))
    _check_routed_call(spec, inp, got, routing)


def _emu_inputs(spec: MG.MoeGemmSpec, routing: str) -> dict:
    """The inputs of an emulated case: ``random_inputs`` (seed 3), ``uneven`` ids (:func:`_uneven_ids`, the cold
    expert 9 or the last one when E < 10) or ``skew``ed ones; dense: no ids / weights (seed 5)."""
    g = torch.Generator().manual_seed(5 if spec.dense else 3)
    inp = MG.random_inputs(spec, g, skew=routing == "skew")
    if routing == "uneven":
        inp["ids"] = _uneven_ids(spec.rows, spec.k, spec.n_experts, g, cold=min(9, spec.n_experts - 1))
    return inp


def _check_routed_call(spec: MG.MoeGemmSpec, inp: dict, got: dict, routing: str) -> None:
    """An emulated routed call (``got``: :func:`EMU.run`'s buffers) against the torch routing tables and the
    reference (the tolerances of the module docstring)."""
    C, fmt, down_fmt = spec.rows, spec.fmt, spec.down_fmt
    perm, tiles = MG.routing_tables(spec, inp["ids"])
    assert torch.equal(got["perm"], perm)
    assert torch.equal(got["tiles"], tiles)
    if routing == "uneven":
        cold = min(9, spec.n_experts - 1)
        counts = torch.bincount(inp["ids"].reshape(-1), minlength=spec.n_experts)
        assert int(counts[cold]) == 0 and int(counts[5]) > MG.TM
        assert int((tiles[:, 0][tiles[:, 2] > 0] == 5).sum()) == 2
    for n in ("xq", "xs", "hbuf", "hq", "hs", "ybuf", "out"):
        assert bool(torch.isfinite(got[n].float()).all()), f"{n}: unwritten (NaN poison left) elements"
    # h: the same bf16 values up to rare rounding flips (a flipped g or u moves silu(g) * u by up to a few ulps:
    # silu's relative slope 1 + g (1 - sigmoid(g)) reaches ~4 for g around -5)
    hr = MG.reference_h(spec, inp["x"], inp["ids"], inp["weights"], inp["w1"], inp["w3"]).float()
    hg = got["hbuf"].float()
    diff = hg != hr
    assert int(diff.sum()) <= 0.01 * hr.numel()
    assert bool(((hg - hr).abs()[diff] <= _h_flip_bound(spec, inp, diff, hr)).all())
    # the combine: the fp32 sum of the row's expert outputs in ascending expert id, from 0.0, bit for bit
    y = got["ybuf"].float()
    order = torch.argsort(inp["ids"], dim=-1)
    want_sum = torch.zeros(C, spec.hidden)
    for j in range(spec.k):
        want_sum += y.gather(1, order[:, j:j + 1, None].expand(C, 1, spec.hidden))[:, 0]
    assert torch.equal(got["out"], want_sum)
    # the down phase + combine against the reference's, on the kernel's own h
    out = got["out"]
    ref_d = MG.reference_down(spec, got["hbuf"], inp["ids"], inp["w2"])
    assert bool(((out - ref_d).abs() <= 2.0 ** -7 * y.abs().sum(1) + 1e-6).all())
    assert float((out != ref_d).double().mean()) <= flip_fraction_bound(spec.inter)
    # the whole call against the reference: also carries the h flips (each moves all D outputs of its pair)
    ref = MG.reference(spec, **inp)
    if fmt == "mxfp4" and down_fmt == "mxfp4" and int(diff.sum()) == 0 and spec.inter <= 128:
        # exact products and sums (module docstring); with two 128-blocks of h per down row (I = 256) the fp32 sum
        # of the two scaled block partials can round differently (observed: 1 of 19712 outputs, rel-L2 6e-10)
        assert torch.equal(out, ref)
    assert MG.rel_l2(out, ref) <= 2 * BF16_ULP


#: the wide tile (MoeGemmSpec.bn 128) against the 64-wide kernel on the same inputs: (C, fmt, down_fmt, routing,
#: sizes); the up phase of W = I 256 is 8 CTA columns of 32 intermediate columns (4 of 64 at bn 128), the down phase
#: 4 of 64 (2 of 128) over D 256
W = dict(hidden=256, inter=256, k=3, n_experts=8)
WIDE_CASES = [
    (77, "mxfp4", "mxfp4", "uneven", W),  # the hot expert in two tiles, one expert unused
    (70, "q8_0", "q8_0", "skew", W),
    # Q3_K gate / up through cp.async (w_async: the W1 / W3 row split of mg_cp_w), Q4_K down through registers
    (33, "q3_k", "q4_k", "skew", KQ),
    (64, "q8_0", "mxfp4", "dense", dict(hidden=256, inter=256, k=1, n_experts=1)),
]
#: the cp.async pipeline (stages 3) at both widths: its weight units of 4 (MXFP4, Q3_K), 8 (Q8_0) and 16 bytes
#: (Q4_K), the gathered up rows and the contiguous down rows, a tile's rows past its count (zeroed once)
PIPE_CASES = [(*WIDE_CASES[0], 64, 3), (*WIDE_CASES[2], 128, 3), (*WIDE_CASES[3], 64, 3),
              # the prefill lowering's default for cp.async-staged K-quants (moe_gemm.auto_stages): Q2_K up, Q6_K down
              (40, "q2_k", "q6_k", "skew", KQ, 64, 3)]


@pytest.mark.parametrize("C,fmt,down_fmt,routing,sizes,bn,stages,eager",
                         [(*c, 128, 2, False) for c in WIDE_CASES] + [(*c, False) for c in PIPE_CASES]
                         + [(*c, True) for c in PIPE_CASES[:2]])
def test_emulated_tile_variants(C: int, fmt: str, down_fmt: str, routing: str, sizes: dict, bn: int,
                                stages: int, eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bn`` 128 (256 threads, up 64 W1 + 64 W3 rows, down 128 W2 rows per CTA) and the 3-stage cp.async
    pipeline: every written buffer (poisoned before) bit-identical to the measured kernel's (64 wide, 2 stages) on
    the same inputs (the same MMAs in the same order per output, the same epilogue), and against the reference as
    that call is (:func:`_check_routed_call`; dense: the bf16 floor of :func:`test_emulated_dense_call`). ``eager``:
    the emulator's cp.async copies land at their issue, not at their wait (a copy into a stage another warp still
    reads would overwrite its operands)."""

    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    if eager:
        monkeypatch.setenv("DS4C_EMU_CP_EAGER", "1")
    dense = routing == "dense"
    narrow = MG.MoeGemmSpec(rows=C, fmt=fmt, down_fmt=down_fmt, dense=dense, **sizes)
    wide = MG.MoeGemmSpec(rows=C, fmt=fmt, down_fmt=down_fmt, dense=dense, bn=bn, stages=stages, **sizes)
    tgt = target("sm_90")
    for kn, a, b in zip(MG.kernel_names(wide, tgt), MG.launch_shapes(narrow, tgt), MG.launch_shapes(wide, tgt)):
        if kn in ("up", "down"):
            assert b.block == (2 * bn, 1, 1) and b.grid == (a.grid[0], a.grid[1] * 64 // bn, 1)
            assert b.smem > a.smem
        else:
            assert a == b
    assert MG.plan(wide, tgt, "up").w_async == (fmt in ("q2_k", "q3_k", "q6_k"))
    assert MG.plan(wide, tgt, "up").stages == stages
    inp = _emu_inputs(narrow, routing)
    with tempfile.TemporaryDirectory() as d:
        got = EMU.run(wide, inp, Path(d))
    with tempfile.TemporaryDirectory() as d:
        ref64 = EMU.run(narrow, inp, Path(d))
    assert set(got) == set(ref64)
    for n in got:
        assert torch.equal(got[n].view(torch.uint8), ref64[n].view(torch.uint8)), f"{n}: {wide.short()} differs"
    if not dense:
        _check_routed_call(wide, inp, got, routing)
        return
    for n, t in got.items():
        assert bool(torch.isfinite(t.float()).all()), f"{n}: unwritten (NaN poison left) elements"
    ref = MG.reference(wide, **inp)
    assert MG.rel_l2(got["out"], ref) <= 2 * BF16_ULP
    assert float((got["out"] != ref).double().mean()) <= 2 * flip_fraction_bound(wide.inter)


def _emulate_beside(spec: MG.MoeGemmSpec, base: MG.MoeGemmSpec, routing: str, wide: bool = False
                    ) -> tuple[dict, dict, dict]:
    """``(inputs, spec's buffers, base's buffers)``: both calls emulated on the same inputs (:func:`_emu_inputs` of
    ``routing``, with ``wide`` the exponents of :func:`_widen_scales`)."""
    inp = _emu_inputs(spec, routing)
    if wide:
        _widen_scales(inp)
    with tempfile.TemporaryDirectory() as d:
        got = EMU.run(spec, inp, Path(d))
    with tempfile.TemporaryDirectory() as d:
        old = EMU.run(base, inp, Path(d))
    return inp, got, old


def _widen_scales(inp: dict) -> None:
    """Every exponent byte of every MXFP4 block of ``w1`` / ``w3`` / ``w2`` drawn from 1..160 (seed 11): blocks up to
    2^159 apart inside a row, some past 2^127 (bf16's second factor in wgmma, the rounded table in wgmma8)."""
    g = torch.Generator().manual_seed(11)
    for n in ("w1", "w3", "w2"):
        b = inp[n].view(-1, 17)
        b[:, 0] = torch.randint(1, 161, (b.shape[0],), generator=g, dtype=torch.uint8)
    assert any(bool((inp[n].view(-1, 17)[:, 0] > 128).any()) for n in ("w1", "w3", "w2"))


#: the up / down phases on wgmma (MoeGemmSpec.mma): (C, routing, sizes, shared, eager, scales); ``scales`` "wide":
#: the MXFP4 exponent bytes drawn from 1..160 instead of 118..124 (the second bf16 factor of E > 128, tiny blocks)
WG_CASES = [(77, "uneven", TINY, False, False, ""),   # the hot expert in two tiles, one unused, a partial tile
            (70, "skew", SMALL, False, False, ""),    # three K steps up, two down (the stage ring wraps)
            (70, "skew", SMALL, False, True, ""),     # cp.async copies landing at their issue
            (77, "uneven", TINY, True, False, ""),    # the fused shared combine
            (40, "skew", W, False, False, "wide")]


@pytest.mark.parametrize("C,routing,sizes,shared,eager,scales", WG_CASES)
def test_emulated_wgmma(C: int, routing: str, sizes: dict, shared: bool, eager: bool, scales: str,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``mma`` wgmma (bf16 operands with every scale folded in, one fp32 accumulation over K; the activations in
    actq form bf16p): the routing, h and the call against the reference as the mma.sync call is
    (:func:`_check_routed_call`), and close to the mma.sync call on the same inputs (both within a bf16 ulp of the
    reference; they differ only where a bf16 rounding of g, u, h or y flips). ``xq`` / ``hq`` are the bf16p form:
    the FP8 quant of x / of the call's own h (``quant.act_quant_fp8``), e4m3 times its scale, at
    :func:`actq.bf16p_positions`, with the scales in ``xs`` / ``hs``."""
    from ds4c import quant
    from ds4c.runtime.families.actq import bf16p_positions

    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    if eager:
        monkeypatch.setenv("DS4C_EMU_CP_EAGER", "1")
    spec = MG.MoeGemmSpec(rows=C, shared=shared, mma="wgmma", **sizes)
    sync = MG.MoeGemmSpec(rows=C, shared=shared, **sizes)
    tgt = target("sm_90")
    src = {s.entry.rsplit("_", 1)[-1]: s for s in MG.render_moe_gemm(spec, tgt)}
    assert src["up"].target == target("sm_90a") and src["route"].target == tgt  # wgmma needs sm_90a code
    assert "wgmma.mma_async" in src["down"].source and "mma.sync" not in src["down"].source.split("---- shape")[1]
    inp, got, old = _emulate_beside(spec, sync, routing, scales == "wide")
    assert got["xq"].dtype == torch.bfloat16 and old["xq"].dtype == torch.float16
    # xq / hq: the FP8 quant of x / the call's own h (quant.act_quant_fp8), e4m3 * 2^k as bf16 at the bf16p positions
    for src, q, sc, k in ((inp["x"], "xq", "xs", spec.hidden), (got["hbuf"], "hq", "hs", spec.inter)):
        e4, s = quant.act_quant_fp8(src.to(torch.bfloat16))
        want = (e4.view(e4.shape[0], -1, 128) * s.unsqueeze(-1)).view(-1, k).to(torch.bfloat16)
        perm = torch.empty_like(want)
        perm[:, torch.tensor(bf16p_positions(k))] = want
        assert torch.equal(got[q].view(torch.int16), perm.view(torch.int16)), q
        assert torch.equal(got[sc], s), sc
    if shared:
        ref = MG.reference(spec, **inp)
        assert bool(torch.isfinite(got["out"].float()).all())
        assert_same_roundings(got["out"], ref, k=spec.inter, what="wgmma combine with shared")
        return
    _check_routed_call(spec, inp, got, routing)
    assert MG.rel_l2(got["out"], old["out"]) <= 2 * BF16_ULP


@pytest.mark.parametrize("bn,eager", [(128, False), (256, False), (256, True)])
def test_emulated_wgmma_widths(bn: int, eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """wgmma with 2 / 4 warpgroups a CTA (bn 128 / 256, 256 / 512 threads; up: the W1 rows in the first half of the
    warpgroups, W3 in the second), also with the column blocks first: every written buffer bit-identical to the one
    warpgroup kernel's (each output is the same 8 MMAs a K step on the same operands); ``eager``: cp.async copies
    landing at their issue."""
    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    if eager:
        monkeypatch.setenv("DS4C_EMU_CP_EAGER", "1")
    one = MG.MoeGemmSpec(rows=70, mma="wgmma", **W)
    wide = MG.MoeGemmSpec(rows=70, mma="wgmma", bn=bn, cols_first=eager, **W)
    tgt = target("sm_90")
    up = MG.plan(wide, tgt, "up")
    assert up.block == (2 * bn, 1, 1) and (up.grid[0] if eager else up.grid[1]) == W["inter"] // (bn // 2)
    inp = _emu_inputs(one, "skew")
    with tempfile.TemporaryDirectory() as d:
        got = EMU.run(wide, inp, Path(d))
    with tempfile.TemporaryDirectory() as d:
        ref = EMU.run(one, inp, Path(d))
    for n in got:
        assert torch.equal(got[n].view(torch.uint8), ref[n].view(torch.uint8)), f"{n}: {wide.short()} differs"
    _check_routed_call(wide, inp, got, "skew")


#: the FP8 wgmma (MoeGemmSpec.mma wgmma8): (C, routing, sizes, bn, eager, scales); "wide": the MXFP4 exponent bytes
#: drawn from 1..160 (blocks up to 2^159 apart inside a row's K step: the rounded table past 2^12, E past 128)
W8_CASES = [(77, "uneven", TINY, 64, False, ""),
            (70, "skew", SMALL, 128, True, ""),
            (40, "skew", W, 256, False, "wide")]


@pytest.mark.parametrize("C,routing,sizes,bn,eager,scales", W8_CASES)
def test_emulated_wgmma8(C: int, routing: str, sizes: dict, bn: int, eager: bool, scales: str,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``mma`` wgmma8 (e4m3 A and B, one promotion a K step): against the reference as every call
    (:func:`_check_routed_call`) and against the mma.sync f16 call on the same inputs: bit for bit where every block of
    a row's K step is within 2^12 of its largest (the table is exact; the emulator sums exactly), within two bf16 ulps
    (relative L2) with "wide" scales; ``xq`` / ``hq`` the e4m3 codes; ``eager``: cp.async copies landing at issue."""
    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    if eager:
        monkeypatch.setenv("DS4C_EMU_CP_EAGER", "1")
    spec = MG.MoeGemmSpec(rows=C, mma="wgmma8", xfmt="e4m3", bn=bn, **sizes)
    sync = MG.MoeGemmSpec(rows=C, **sizes)
    tgt = target("sm_90")
    src = {s.entry.rsplit("_", 1)[-1]: s for s in MG.render_moe_gemm(spec, tgt)}
    assert src["up"].target == target("sm_90a") and MG.act_form(spec) == "e4m3s" and "_w8" in spec.key()
    body = src["down"].source.split("---- shape")[1]
    assert "xp_wg8_m64n64k32(" in body and "mma.sync" not in body and "m64n64k16" not in body
    inp, got, old = _emulate_beside(spec, sync, routing, scales == "wide")
    assert got["xq"].dtype == torch.float8_e4m3fn and torch.equal(got["xq"].float(), old["xq"].float())
    _check_routed_call(spec, inp, got, routing)
    if scales == "wide":
        assert MG.rel_l2(got["out"], old["out"]) <= 2 * BF16_ULP
    else:
        for n in ("hbuf", "ybuf", "out"):
            assert torch.equal(got[n].view(torch.uint8), old[n].view(torch.uint8)), n


@pytest.mark.parametrize("drop, why", [("  xp_wg_fence();\n", "no wgmma.fence"),
                                       ("  xp_wg_wait<0>();\n", "still reads"),
                                       ("sbase + (u32)", "")])
def test_emulated_wgmma_catches_ordering_and_address_faults(drop: str, why: str, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The emulator's wgmma is not computed-at-issue only: a kernel without its wgmma.fence, or without the
    wait_group before the stage is refilled, aborts with the rule it broke; a descriptor built without the shared
    array's address (the emulator places it at a non-zero one) reads the wrong bytes and the outputs go wrong."""
    why_not = EMU.host_unavailable()
    if why_not:
        pytest.skip(why_not)
    spec = MG.MoeGemmSpec(rows=40, mma="wgmma", hidden=512, inter=128, k=2, n_experts=8)  # up: 4 K steps, refills
    real = MG.render_moe_gemm

    def broken(sp, tgt, name=None):
        out = real(sp, tgt, name)
        for s in out:
            if s.entry.endswith(("_up", "_down")):
                assert drop in s.source
                object.__setattr__(s, "source", s.source.replace(drop, "", 1))
        return out

    monkeypatch.setattr(MG, "render_moe_gemm", broken)
    inp = _emu_inputs(spec, "skew")
    with tempfile.TemporaryDirectory() as d:
        if why:
            with pytest.raises(RuntimeError, match=why):
                EMU.run(spec, inp, Path(d))
            return
        got = EMU.run(spec, inp, Path(d))
    assert MG.rel_l2(got["out"], MG.reference(spec, **inp)) > 0.1


def test_auto_mma() -> None:
    """The routed call's MMA with DS4C_PREFILL_MOE_MMA=wgmma: wgmma for MXFP4 both ways at any of its widths with
    stages unset / 3 on sm_90 / sm_90a; mma.sync for any other format, forced 2 stages or target."""
    t90, t90a, t100 = target("sm_90"), target("sm_90a"), target("sm_100a")
    assert MG.auto_mma("mxfp4", "mxfp4", 0, 0, t90) == "wgmma" == MG.auto_mma("mxfp4", "mxfp4", 64, 3, t90a)
    assert MG.auto_mma("mxfp4", "mxfp4", 128, 0, t90) == "wgmma" == MG.auto_mma("mxfp4", "mxfp4", 256, 0, t90)
    for args in (("q3_k", "q3_k", 0, 0, t90), ("mxfp4", "q8_0", 0, 0, t90), ("q8_0", "q8_0", 0, 0, t90),
                 ("mxfp4", "mxfp4", 0, 2, t90), ("mxfp4", "mxfp4", 0, 0, t100)):
        assert MG.auto_mma(*args) == "sync", args
    # fp8: MXFP4 both ways on CUDA at any width, stage count and e4m3 arch (Blackwell included); else mma.sync
    for args in (("mxfp4", "mxfp4", 0, 0, t90), ("mxfp4", "mxfp4", 128, 2, t90a), ("mxfp4", "mxfp4", 64, 3, t100)):
        assert MG.auto_mma(*args, want="fp8") == "fp8", args
    for args in (("mxfp4", "q8_0", 0, 0, t90), ("q3_k", "q3_k", 0, 0, t90), ("mxfp4", "mxfp4", 0, 0, target("gfx942"))):
        assert MG.auto_mma(*args, want="fp8") == "sync", args
    assert MG.auto_mma("mxfp4", "mxfp4", 0, 0, t90, want="sync") == "sync"
    # wgmma8: where wgmma is built
    assert MG.auto_mma("mxfp4", "mxfp4", 256, 0, t90, want="wgmma8") == "wgmma8"
    assert MG.auto_mma("mxfp4", "mxfp4", 0, 2, t90, want="wgmma8") == "sync" == MG.auto_mma(
        "mxfp4", "mxfp4", 0, 0, t100, want="wgmma8")


def test_prefill_lowering_moe_mma(monkeypatch: pytest.MonkeyPatch) -> None:
    """DS4C_PREFILL_MOE_MMA=wgmma: the chunk's routed MXFP4 up / down run on wgmma (sm_90a code, actq form bf16p,
    DS4C_PREFILL_MOE_WG_BN wide: 256 by default, 512 threads), the Q8_0 shared expert on mma.sync; unset or ``sync``:
    every call on mma.sync; another word: a one-line SettingsError."""
    from ds4c.config import preset
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph
    from ds4c.settings import SettingsError

    g = run_pipeline(build_step(preset("tiny"), 64, max_ctx=128, prefill=True), "default", context=128).graph

    def entries(value: str | None) -> list[tuple[str, str]]:
        monkeypatch.setenv("DS4C_PREFILL_MOE_MMA", value) if value else monkeypatch.delenv("DS4C_PREFILL_MOE_MMA",
                                                                                          raising=False)
        ks = [k for k in lower_graph(g, preset("tiny"), target("sm_90"), pending=[]) if k.family == "moe_gemm"]
        return [(la.kernel.entry.removeprefix("ds4c_moe_"), la.kernel.target.arch, la.kernel.params.get("form"),
                 la.kernel.params.get("wg")) for la in ks[0].launches]

    def threads(value: str | None) -> list[int]:
        monkeypatch.setenv("DS4C_PREFILL_MOE_MMA", "wgmma")
        monkeypatch.setenv("DS4C_PREFILL_MOE_WG_BN", value) if value else monkeypatch.delenv(
            "DS4C_PREFILL_MOE_WG_BN", raising=False)
        ks = [k for k in lower_graph(g, preset("tiny"), target("sm_90"), pending=[]) if k.family == "moe_gemm"]
        return [la.block[0] for la in ks[0].launches if la.kernel.params.get("wg")]

    assert threads(None) == [512, 512] and threads("64") == [128, 128] and threads("128") == [256, 256]
    assert MG.wg_width(256, 4096) == 256 and MG.wg_width(256, 384) == 128 and MG.wg_width(64, 384) == 64
    monkeypatch.delenv("DS4C_PREFILL_MOE_WG_BN")
    auto, sync = entries("wgmma"), entries(None)
    assert [e for e, _, _, wg in auto if wg] == ["gemm_up", "gemm_down"]
    assert all(a == ("sm_90a" if wg else "sm_90") for _, a, _, wg in auto)
    # the routed activations in form bf16p; the Q8_0 shared expert quantizes x again in form e4m3s (one more launch)
    assert [(e, f) for e, _, f, _ in auto if f] == [("gemm_actq_x", "bf16p"), ("gemm_actq_h", "bf16p"),
                                                    ("shexp_actq_x", "e4m3s"), ("shexp_actq_h", "e4m3s")]
    assert not any(wg for *_, wg in sync) and all(a == "sm_90" for _, a, _, _ in sync)
    assert [e for e, *_ in sync] == [e for e, *_ in auto if e != "shexp_actq_x"]
    assert entries("sync") == sync
    with pytest.raises(SettingsError) as ei:
        entries("auto")
    assert "DS4C_PREFILL_MOE_MMA" in str(ei.value) and "\n" not in str(ei.value)
    # fp8: the routed MXFP4 up / down on the e4m3 MMA (sm_90 code), both calls' activations in form e4m3s, so the
    # Q8_0 shared expert (mma.sync on e4m3 tiles) reads the routed call's x: no second quant launch
    f8 = entries("fp8")
    assert [e for e, *_ in f8] == [e for e, *_ in sync] and all(a == "sm_90" for _, a, _, _ in f8)
    assert {f for _, _, f, _ in f8 if f} == {"e4m3s"}
    ks = [k for k in lower_graph(g, preset("tiny"), target("sm_90"), pending=[]) if k.family == "moe_gemm"]
    assert [la.kernel.params.get("f8") for la in ks[0].launches if la.kernel.params.get("kernel") in ("up", "down")
            ] == [True, True, False, False]  # the routed up / down, then the shared expert's (Q8_0: mma.sync)
    # wgmma8: the routed up / down on the FP8 wgmma (sm_90a, DS4C_PREFILL_MOE_WG_BN wide), e4m3 tiles both calls
    w8 = entries("wgmma8")
    assert [e for e, *_ in w8] == [e for e, *_ in sync] and {f for _, _, f, _ in w8 if f} == {"e4m3s"}
    assert [(e, a) for e, a, _, wg in w8 if wg] == [("gemm_up", "sm_90a"), ("gemm_down", "sm_90a")]


def test_prefill_lowering_moe_xq(monkeypatch: pytest.MonkeyPatch) -> None:
    """DS4C_PREFILL_MOE_XQ=e4m3 (the default): both grouped-experts calls (routed, shared expert) stage e4m3 tiles
    (actq form e4m3s, u8 activation pointers) on f16 mma.sync, the shared expert reading the routed call's x; ``f16``:
    form f16s, the same launches; on HIP the knob is ignored (its body reads f16); a bad word: one line."""
    from ds4c.config import preset
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph
    from ds4c.settings import SettingsError

    g = run_pipeline(build_step(preset("tiny"), 64, max_ctx=128, prefill=True), "default", context=128).graph

    def calls(value: str | None, arch: str = "sm_90") -> list:
        monkeypatch.setenv("DS4C_PREFILL_MOE_XQ", value) if value else monkeypatch.delenv("DS4C_PREFILL_MOE_XQ",
                                                                                          raising=False)
        ks = [k for k in lower_graph(g, preset("tiny"), target(arch), pending=[]) if k.family == "moe_gemm"]
        return ks[0].launches

    e4, f16 = calls("e4m3"), calls("f16")
    assert [la.kernel.source for la in calls(None)] == [la.kernel.source for la in e4]  # the default
    assert [la.kernel.params.get("form") for la in e4 if la.kernel.params.get("form")] == ["e4m3s"] * 3
    assert [la.kernel.params.get("e4x") for la in e4 if "e4x" in la.kernel.params] == [True] * 4
    assert not any(la.kernel.params.get("f8") for la in e4)
    assert len(e4) == len(f16) and all(la.kernel.params.get("form") in (None, "f16s") for la in f16)
    assert all("const u8* DS4C_RESTRICT xq" in la.kernel.source for la in e4 if la.kernel.params.get("e4x"))
    assert not any(la.kernel.params.get("e4x") for la in calls("e4m3", "gfx942"))
    with pytest.raises(SettingsError) as ei:
        calls("fp8")
    assert "DS4C_PREFILL_MOE_XQ" in str(ei.value) and "\n" not in str(ei.value)


#: e4m3 activation tiles (MoeGemmSpec.xfmt) and the fp8 MMA (MoeGemmSpec.mma fp8): (C, fmt, down_fmt, routing, sizes,
#: bn, stages, mma); the tiles with mma.sync bit for bit against the f16 tiles' call (K-quant decode, the wide tile, the
#: cp.async pipeline, the dense call), the fp8 MMA against the reference and, where the products and block sums are
#: exact (MXFP4, I = 128), against the f16 call bit for bit
E4_CASES = [(77, "mxfp4", "mxfp4", "uneven", TINY, 64, 2, "sync"),
            (33, "q3_k", "q4_k", "skew", KQ, 128, 3, "sync"),
            (64, "q8_0", "mxfp4", "dense", dict(hidden=256, inter=256, k=1, n_experts=1), 64, 2, "sync"),
            (77, "mxfp4", "mxfp4", "uneven", TINY, 64, 2, "fp8"),
            (70, "mxfp4", "mxfp4", "skew", SMALL, 128, 3, "fp8")]


@pytest.mark.parametrize("C,fmt,down_fmt,routing,sizes,bn,stages,mma", E4_CASES)
def test_emulated_e4m3_tiles(C: int, fmt: str, down_fmt: str, routing: str, sizes: dict, bn: int, stages: int,
                             mma: str) -> None:
    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    dense = routing == "dense"
    kw = dict(rows=C, fmt=fmt, down_fmt=down_fmt, dense=dense, bn=bn, stages=stages, **sizes)
    e4 = MG.MoeGemmSpec(xfmt="e4m3", mma=mma, **kw)
    f16 = MG.MoeGemmSpec(**kw)
    tgt = target("sm_90")
    src = {s.entry.rsplit("_", 1)[-1]: s.source for s in MG.render_moe_gemm(e4, tgt)}
    assert "const u8* DS4C_RESTRICT xq" in src["up"] and "#define MG_XST 144" in src["down"]
    body = src["down"].split("---- shape")[1]
    assert ("xp_mma_e4m3(" in body) == (mma == "fp8") and ("xp_mma_f16(" in body) == (mma == "sync")
    # half the bytes of a stage's activation tile
    assert MG.plan(f16, tgt, "up").stage_bytes - MG.plan(e4, tgt, "up").stage_bytes == MG.TM * 128
    assert MG.arg_shapes(e4)["hq"][1] == torch.float8_e4m3fn and MG.act_form(e4) == "e4m3s"
    inp, got, ref16 = _emulate_beside(e4, f16, routing)
    assert set(got) == set(ref16)
    for n in ("xq", "hq"):  # the same e4m3 values, one byte each (every element written: the NaN poison is gone)
        assert got[n].dtype == torch.float8_e4m3fn and torch.equal(got[n].float(), ref16[n].float()), n
    exact = mma == "sync" or spec_exact(e4)
    for n in got:
        if n not in ("xq", "hq") and exact:
            assert torch.equal(got[n].view(torch.uint8), ref16[n].view(torch.uint8)), f"{n}: {e4.short()} differs"
    if not dense:
        _check_routed_call(e4, inp, got, routing)
    else:
        assert MG.rel_l2(got["out"], MG.reference(e4, **inp)) <= 2 * BF16_ULP


def spec_exact(spec: MG.MoeGemmSpec) -> bool:
    """Whether the emulated fp8 and f16 MMAs give the same bits: MXFP4 x e4m3 products and their 32-block sums are
    exact in fp32 (module docstring), and with one 128-block of h per down row (I = 128) so is every later sum."""
    return spec.fmt == spec.down_fmt == "mxfp4" and spec.inter <= 128


def test_l2_prefetch_render(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefetch`` 0 renders the sources byte for byte as before; 128 / 256 add ``.L2::<n>B`` to every cp.async copy of
    the up / down kernels and change nothing else (route, actq, combine equal); DS4C_PREFILL_L2_PREFETCH reaches the
    lowering's routed and shared-expert calls; a bad value is a one-line error."""
    from ds4c.config import preset
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph
    from ds4c.settings import SettingsError

    tgt = target("sm_90")
    for kw in (dict(mma="wgmma"), dict(stages=3), dict(fmt="q3_k", hidden=512, inter=512)):
        base = MG.render_moe_gemm(MG.MoeGemmSpec(rows=64, **{**TINY, **kw}), tgt, "n")
        for pf in (128, 256):
            got = MG.render_moe_gemm(MG.MoeGemmSpec(rows=64, prefetch=pf, **{**TINY, **kw}), tgt, "n")
            for a, b in zip(base, got):
                if a.entry.endswith(("_up", "_down")):
                    n = b.source.count(f"shared.global.L2::{pf}B [")  # every cp.async helper rendered
                    assert n >= 1 and n == a.source.count("shared.global [")
                    assert b.source.replace(f".L2::{pf}B", "") == a.source
                else:
                    assert a.source == b.source
    g = run_pipeline(build_step(preset("tiny"), 64, max_ctx=128, prefill=True), "default", context=128).graph
    for value, want in ((None, 0), ("256", 256), ("128", 128)):
        monkeypatch.setenv("DS4C_PREFILL_L2_PREFETCH", value) if value else monkeypatch.delenv(
            "DS4C_PREFILL_L2_PREFETCH", raising=False)
        ks = [k for k in lower_graph(g, preset("tiny"), tgt, pending=[]) if k.family == "moe_gemm"]
        assert {la.kernel.params["prefetch"] for la in ks[0].launches if "prefetch" in la.kernel.params} == {want}
    monkeypatch.setenv("DS4C_PREFILL_L2_PREFETCH", "64")
    with pytest.raises(SettingsError) as ei:
        lower_graph(g, preset("tiny"), tgt, pending=[])
    assert "DS4C_PREFILL_L2_PREFETCH" in str(ei.value) and "\n" not in str(ei.value)


def test_wide_tile_render() -> None:
    """``bn`` 0 and 64 render the same sources (the measured 64-wide text); 128 changes only the up / down kernels
    (route, actq and combine are shared), names them ``_bn128`` and fits sm_90's shared memory for every format;
    a bad width is a one-line RenderError."""
    t = target("sm_90")
    for spec in (MG.MoeGemmSpec(2048), MG.MoeGemmSpec(2048, k=1, n_experts=1, fmt="q8_0", dense=True),
                 MG.MoeGemmSpec(512, fmt="q3_k", down_fmt="q6_k")):
        base = MG.render_moe_gemm(spec, t)
        same = MG.render_moe_gemm(MG.MoeGemmSpec(**{**spec.__dict__, "bn": 64}), t)
        assert [(s.entry, s.source) for s in base] == [(s.entry, s.source) for s in same]
        wide = MG.render_moe_gemm(MG.MoeGemmSpec(**{**spec.__dict__, "bn": 128}), t, "m")
        narrow = MG.render_moe_gemm(spec, t, "m")
        for a, b in zip(narrow, wide):
            assert (a.source == b.source) == (not a.entry.endswith(("_up", "_down"))), a.entry
            if a.entry.endswith(("_up", "_down")):
                assert "#define MG_NT 128 " in a.source and "#define MG_NT 256 " in b.source
                assert "__launch_bounds__(MG_NT, 2)" in a.source and "__launch_bounds__(MG_NT, 1)" in b.source
        assert all("_bn128_" in s.entry for s in MG.render_moe_gemm(MG.MoeGemmSpec(**{**spec.__dict__, "bn": 128}), t))
    for fmt in MG.FORMATS:
        for ph in ("up", "down"):
            pl = MG.plan(MG.MoeGemmSpec(4096, fmt=fmt, bn=128), t, ph)
            assert pl.block == (256, 1, 1) and pl.smem <= MG.SMEM_LIMIT and pl.bn == 128
            assert pl.grid[1] == (2048 // 64 if ph == "up" else 4096 // 128)
    for bad in (32, 96, 256, -64, "128", 128.0, True):
        with pytest.raises(RenderError, match="bn") as ei:
            MG.MoeGemmSpec(64, bn=bad, **TINY)
        assert "\n" not in str(ei.value)


def test_prefill_lowering_moe_bn(monkeypatch: pytest.MonkeyPatch) -> None:
    """DS4C_PREFILL_MOE_BN=128 (ds4c.settings.prefill_moe_bn) gives the prefill chunk's grouped-experts launches
    (the routed call's and the dense shared expert's up / down) 256 threads and half the CTA columns; unset: 128."""
    from ds4c.config import preset
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph

    g = run_pipeline(build_step(preset("tiny"), 64, max_ctx=128, prefill=True), "default", context=128).graph
    monkeypatch.setenv("DS4C_PREFILL_MOE_COLS_FIRST", "0")  # the grid's y: the CTA columns
    got = {}
    for bn in ("", "128"):
        monkeypatch.setenv("DS4C_PREFILL_MOE_BN", bn)
        ks = [k for k in lower_graph(g, preset("tiny"), target("sm_90"), pending=[]) if k.family == "moe_gemm"]
        assert len(ks) == preset("tiny").n_layers
        got[bn] = [(la.kernel.entry.rsplit("_", 1)[-1], la.block[0], la.grid[1]) for la in ks[0].launches
                   if la.kernel.entry.endswith(("_up", "_down"))]
    assert len(got["128"]) == 4 and [t for _, t, _ in got["128"]] == [256] * 4
    assert [t for _, t, _ in got[""]] == [128] * 4
    assert [y for _, _, y in got["128"]] == [y // 2 for _, _, y in got[""]]


def test_auto_stages() -> None:
    """The prefill lowering's default stages (DS4C_PREFILL_STAGES unset): 3 only for 64-wide calls whose both phases
    are cp.async-staged K-quants (measured: Q3_K 0.89x), 2 for the register-staged formats and the 128-wide tile;
    HIP's plan stages the weights through registers (no cp.async, ``w_async`` off)."""
    assert MG.W_ASYNC == ("q2_k", "q3_k", "q6_k")
    for fmt, down, bn, want in [("q3_k", "q3_k", 0, 3), ("q3_k", "q3_k", 64, 3), ("q2_k", "q6_k", 0, 3),
                                ("q3_k", "q3_k", 128, 2), ("q3_k", "q4_k", 0, 2), ("q4_k", "q6_k", 0, 2),
                                ("mxfp4", "mxfp4", 0, 2), ("q8_0", "q8_0", 0, 2), ("iq4_xs", "iq4_xs", 0, 2)]:
        assert MG.auto_stages(fmt, down, bn) == want, (fmt, down, bn)
        # and each w_async format is what plan() stages by cp.async
        for f in (fmt, down):
            if f in MG.KQUANTS:
                assert MG.plan(MG.MoeGemmSpec(2048, fmt=f), target("sm_90"), "up").w_async == (f in MG.W_ASYNC)
    assert not MG.plan(MG.MoeGemmSpec(2048, fmt="q3_k"), target("gfx942"), "up").w_async


def test_prefill_lowering_uses_auto_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """With DS4C_PREFILL_STAGES unset the lowering asks :func:`moe_gemm.auto_stages` per call (formats and width):
    what it answers reaches the routed and the shared-expert launches."""
    from ds4c.config import preset
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph

    monkeypatch.delenv("DS4C_PREFILL_STAGES", raising=False)
    monkeypatch.setenv("DS4C_PREFILL_MOE_MMA", "sync")  # the mma.sync kernels' stages (wgmma has its own pipeline)
    g = run_pipeline(build_step(preset("tiny"), 64, max_ctx=128, prefill=True), "default", context=128).graph
    asked = []

    def smem(answer: int) -> list[int]:
        monkeypatch.setattr(MG, "auto_stages", lambda f, d, bn=0: asked.append((f, d, bn)) or answer)
        ks = lower_graph(g, preset("tiny"), target("sm_90"), pending=[])
        return [la.smem for k in ks if k.family == "moe_gemm" for la in k.launches if la.smem]

    two, three = smem(2), smem(3)
    assert asked and all(bn == 64 for _, _, bn in asked) and len(two) == len(three)
    assert all(b > a for a, b in zip(two, three))


def test_prefill_lowering_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """DS4C_PREFILL_STAGES=3 (ds4c.settings.prefill_stages) gives the chunk's grouped experts (up / down) and its
    prequant GEMMs the cp.async pipeline (a third stage of shared memory); 2 and unset (auto: the tiny
    official experts are MXFP4 / Q8_0, not cp.async-staged K-quants) the 2-stage kernels."""
    from ds4c.config import preset
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph

    monkeypatch.setenv("DS4C_PREFILL_MOE_MMA", "sync")  # the mma.sync kernels' stages (wgmma has its own pipeline)
    g = run_pipeline(build_step(preset("tiny"), 64, max_ctx=128, prefill=True), "default", context=128).graph
    got = {}
    for st in ("", "2", "3"):
        monkeypatch.setenv("DS4C_PREFILL_STAGES", st) if st else monkeypatch.delenv("DS4C_PREFILL_STAGES", raising=False)
        ks = lower_graph(g, preset("tiny"), target("sm_90"), pending=[])
        got[st] = [(k.family, la.kernel.entry, la.smem) for k in ks if k.family in ("moe_gemm", "gemm")
                   for la in k.launches if la.smem]  # the GEMM / up / down launches (route, actq, combine: none)
    assert got[""] == got["2"]
    assert [(f, e) for f, e, _ in got["2"]] == [(f, e) for f, e, _ in got["3"]]
    grew = [(f, b > a) for (f, _, a), (_, _, b) in zip(got["2"], got["3"]) if b >= a]
    assert len(grew) == len(got["2"])  # none shrinks; the GEMMs that are no prequant call (the grouped wo_a) stay
    assert all(g for f, g in grew if f == "moe_gemm") and any(g for f, g in grew if f == "gemm")


@pytest.mark.parametrize("C,fmt,down_fmt", [(77, "q8_0", "q8_0"), (64, "mxfp4", "q8_0")])
def test_emulated_dense_call(C: int, fmt: str, down_fmt: str) -> None:
    """``dense`` (the shared expert: E = 1, k = 1, no routing, no weight multiply): four launches, every hbuf / out
    element written; ``out`` bf16 [C, D] against ``reference`` (``expert_ffn`` of the one expert, no weight: the IR
    shared expert's linear / swiglu / cast / linear): the same bf16 values up to the documented flips (Q8_0: rare
    fp32-order flips of g / u / y roundings), rel-L2 < 1e-3; equal to the routed call with every row routed to
    expert 0 at weight 1.0 (ids 0, weights 1) bit for bit (x * 1.0 is exact)."""

    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    spec = MG.MoeGemmSpec(rows=C, hidden=256, inter=128, k=1, n_experts=1, fmt=fmt, down_fmt=down_fmt, dense=True)
    assert MG.kernel_names(spec, target("sm_90")) == ["actq_x", "up", "actq_h", "down"]
    assert MG.tile_slots(spec) == -(-C // MG.TM)
    inp = MG.random_inputs(spec, torch.Generator().manual_seed(5))
    assert set(inp) == {"x", "w1", "w3", "w2"}
    with tempfile.TemporaryDirectory() as d:
        got = EMU.run(spec, inp, Path(d))
    assert set(got) == {"xq", "xs", "hbuf", "hq", "hs", "out"} and got["out"].dtype == torch.bfloat16
    for n, t in got.items():
        assert bool(torch.isfinite(t.float()).all()), f"{n}: unwritten (NaN poison left) elements"
    ref = MG.reference(spec, **inp)
    assert ref.dtype == torch.bfloat16 and ref.shape == got["out"].shape
    # two chained bf16 roundings (h, out) each at most one ulp apart per element, each flipping at most
    # flip_fraction_bound of its elements (the down projection spreads an h flip over a row, so count out's flips
    # against the up projection's bound too)
    assert MG.rel_l2(got["out"], ref) <= 2 * BF16_ULP
    assert float((got["out"] != ref).double().mean()) <= 2 * flip_fraction_bound(spec.inter)
    # the same as a routed call of expert 0 with weight 1.0 on every row
    rspec = MG.MoeGemmSpec(rows=C, hidden=256, inter=128, k=1, n_experts=1, fmt=fmt, down_fmt=down_fmt)
    rin = dict(inp, ids=torch.zeros(C, 1, dtype=torch.int64), weights=torch.ones(C, 1))
    with tempfile.TemporaryDirectory() as d:
        r = EMU.run(rspec, rin, Path(d))
    assert torch.equal(r["hbuf"].view(torch.int16), got["hbuf"].view(torch.int16))
    assert torch.equal(r["out"], got["out"].float())


def test_emulated_combine_with_shared() -> None:
    """``shared`` (moe_sum fused into the combine): ``out`` bf16 = bf16(ordered fp32 sum of ybuf + fp32(shared))
    bit for bit, and against ``reference`` with ``shared`` (``moe_sum`` of the per-row routed_sum) within the routed
    call's floor (MXFP4 here: bit for bit); dropping the shared add would miss by the shared values (checked)."""

    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    spec = MG.MoeGemmSpec(rows=77, shared=True, **TINY)
    assert MG.arg_names(spec)["combine"] == ["ids", "ybuf", "shared", "out"]
    g = torch.Generator().manual_seed(9)
    inp = MG.random_inputs(spec, g)
    inp["ids"] = _uneven_ids(77, spec.k, spec.n_experts, g)
    with tempfile.TemporaryDirectory() as d:
        got = EMU.run(spec, inp, Path(d))
    out = got["out"]
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out.float()).all())
    y = got["ybuf"].float()
    order = torch.argsort(inp["ids"], dim=-1)
    acc = torch.zeros(77, spec.hidden)
    for j in range(spec.k):
        acc += y.gather(1, order[:, j:j + 1, None].expand(77, 1, spec.hidden))[:, 0]
    want = (acc + inp["shared"].float()).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(out, acc.to(torch.bfloat16))  # the shared add is there
    ref = MG.reference(spec, **inp)
    assert ref.dtype == torch.bfloat16
    assert_same_roundings(out, ref, k=spec.inter, what="combine with shared")


def test_dense_and_shared_options_render_nothing_when_off() -> None:
    """Both options off: the sources carry no trace of them (the measured kernels); on: the dense up / down take no
    routing arguments and skip the weight multiply, the shared combine takes ``shared`` and stores bf16."""
    t = target("sm_90")
    off = {s.entry.rsplit("_", 1)[-1]: s.source for s in MG.render_moe_gemm(MG.MoeGemmSpec(64, **TINY), t, "m")}
    assert all("DS4C_RESTRICT shared" not in src and "dense" not in src and "weight 1" not in src for src in off.values())
    d = MG.MoeGemmSpec(64, hidden=256, inter=128, k=1, n_experts=1, fmt="q8_0", dense=True)
    dn = {s.entry.rsplit("_", 1)[-1]: s.source for s in MG.render_moe_gemm(d, t, "m")}
    assert set(dn) == {"x", "up", "h", "down"}
    def sig(src: str) -> str:
        return src[src.index("__launch_bounds__(MG_NT"):].split(") {", 1)[0]

    assert "weights" not in sig(dn["up"]) and "perm" not in sig(dn["up"]) and "tiles" not in sig(dn["down"])
    assert "wv * hv" not in dn["up"] and "perm[" not in dn["up"] and "perm[" not in dn["down"]
    sh = MG.render_moe_gemm(MG.MoeGemmSpec(64, shared=True, **TINY), t, "m")[-1].source
    assert "const u16* DS4C_RESTRICT shared, u16* DS4C_RESTRICT out" in sh and "ds4c_bf16_to_f32(shared[" in sh
    for kw in (dict(k=2), dict(n_experts=2), dict(shared=True)):
        with pytest.raises(RenderError, match="dense"):
            MG.MoeGemmSpec(64, **{**dict(hidden=256, inter=128, k=1, n_experts=1, dense=True), **kw})


# ------------------------------------------------------------------------------------------ device compile
def test_device_compile_sm90(tmp_path: Path) -> None:
    """Flash-sized kernels (C 2048, D 4096, I 2048, E 256, k 6; MXFP4, Q8_0 down, all Q8_0; the combine with
    ``shared``; the dense Q8_0 shared-expert call; the up / down phases of every K-quant and IQ4_XS, and of the
    128-wide tile (``bn`` 128) for MXFP4 and Q3_K) compile for sm_90 with no spills and no stack frame."""
    why = compiler_missing("sm_90")
    if why:
        pytest.skip(f"no compiler for sm_90: {why}")
    tgt = target("sm_90")
    dense = MG.MoeGemmSpec(rows=2048, k=1, n_experts=1, fmt="q8_0", dense=True)  # flash's shared expert
    for spec in (MG.MoeGemmSpec(rows=2048), MG.MoeGemmSpec(rows=512, down_fmt="q8_0"), MG.MoeGemmSpec(rows=64, fmt="q8_0"),
                 MG.MoeGemmSpec(rows=2048, shared=True), dense, MG.MoeGemmSpec(rows=2048, fmt="q3_k"),
                 MG.MoeGemmSpec(rows=2048, fmt="q4_k", down_fmt="q6_k"),
                 MG.MoeGemmSpec(rows=2048, fmt="q5_k", down_fmt="q2_k"), MG.MoeGemmSpec(rows=2048, fmt="iq4_xs"),
                 # the wide tile (bn 128, 256 threads): MXFP4 and Q3_K (cp.async weights) at the flash shapes
                 MG.MoeGemmSpec(rows=2048, bn=128), MG.MoeGemmSpec(rows=2048, fmt="q3_k", bn=128),
                 # the 3-stage pipeline: MXFP4 at 3 CTAs a SM (168 registers), the cp.async-staged K-quants
                 MG.MoeGemmSpec(rows=2048, stages=3), MG.MoeGemmSpec(rows=2048, fmt="q2_k", down_fmt="q6_k", stages=3),
                 # wgmma (compiled for sm_90a): 1 warpgroup at 3 CTAs a SM, 2 and 4 at 128 registers a thread
                 MG.MoeGemmSpec(rows=2048, mma="wgmma"), MG.MoeGemmSpec(rows=2048, mma="wgmma", bn=128),
                 MG.MoeGemmSpec(rows=2048, mma="wgmma", bn=256),
                 # e4m3 tiles: the register-staged and pipelined MXFP4, a K-quant, the wide tile; the fp8 MMA
                 MG.MoeGemmSpec(rows=2048, xfmt="e4m3"), MG.MoeGemmSpec(rows=2048, xfmt="e4m3", stages=3),
                 MG.MoeGemmSpec(rows=2048, fmt="q3_k", xfmt="e4m3"), MG.MoeGemmSpec(rows=2048, bn=128, xfmt="e4m3"),
                 MG.MoeGemmSpec(rows=2048, mma="fp8", xfmt="e4m3"),
                 MG.MoeGemmSpec(rows=2048, mma="fp8", xfmt="e4m3", bn=128, stages=3),
                 # the FP8 wgmma (sm_90a) at 1 and 4 warpgroups
                 MG.MoeGemmSpec(rows=2048, mma="wgmma8", xfmt="e4m3"),
                 MG.MoeGemmSpec(rows=2048, mma="wgmma8", xfmt="e4m3", bn=256)):
        srcs = MG.render_moe_gemm(spec, tgt)
        if spec.shared:
            srcs = srcs[-1:]  # only the combine differs
        assert [s.entry.rsplit("_", 1)[-1] for s in srcs] == (
            ["x", "up", "h", "down"] if spec.dense else ["combine"] if spec.shared
            else ["route", "x", "up", "h", "down", "combine"])
        if spec.fmt in MG.KQUANTS or spec.bn or spec.stages or spec.mma != "sync" or spec.xfmt != "f16":
            # only the GEMM phases vary (and the actq form, checked in tests/test_actq.py)
            srcs = [s for s in srcs if s.entry.endswith(("_up", "_down"))]
        for s in srcs:
            d = tmp_path / s.entry
            d.mkdir()
            c = compile_kernel(s, d)
            assert_no_spills(c.usage, s, c.log)
            print(s.entry, c.usage.get("registers"), "registers")


def test_launch_shapes_fixed_by_sizes() -> None:
    spec = MG.MoeGemmSpec(rows=2048)
    ls = MG.launch_shapes(spec, target("sm_90"))
    T = 2048 * 6 // 64 + 256
    assert [(l.kernel, l.grid) for l in ls] == [
        ("route", (1, 1, 1)), ("actq_x", (1, 2048, 1)), ("up", (T, 64, 1)), ("actq_h", (1, 2048 * 6, 1)),
        ("down", (T, 64, 1)), ("combine", (32, 2048, 1))]
    assert all(l.smem <= 48 * 1024 for l in ls)  # MXFP4: no opt-in attribute needed
    assert [l.block for l in ls if l.kernel.startswith("actq")] == [(256, 1, 1)] * 2  # actq.py's warp layout
    shapes = MG.arg_shapes(spec)
    for kn, names in MG.arg_names(spec).items():
        assert all(n in shapes for n in names), kn


# ------------------------------------------------------------------------------------------- the HIP body
#: (arch, C, fmt, down_fmt, routing, sizes, bn): MFMA (gfx942, wave 64: two M tiles a wave) and gfx11 WMMA (gfx1151,
#: wave 32: one M tile a wave, the next step's tiles loaded after the products); the hot expert in two tiles and a
#: partial tile, Q8_0's per-block scales after the products, the 128-wide tile; every K-quant and IQ4_XS on wave 64
#: (per-16 scales and the min term of Q2_K, per-32 ones with mins: Q4_K / Q5_K, without: Q3_K, Q6_K, IQ4_XS)
HIP_CASES = [("gfx942", 77, "mxfp4", "mxfp4", "uneven", TINY, 64),
             ("gfx942", 70, "q8_0", "mxfp4", "skew", SMALL, 64),
             ("gfx1151", 77, "mxfp4", "q8_0", "uneven", TINY, 64),
             ("gfx1151", 40, "mxfp4", "mxfp4", "skew", W, 128),
             ("gfx942", 33, "q4_k", "q2_k", "skew", KQ, 64),
             ("gfx942", 33, "q5_k", "q6_k", "skew", KQ, 64),
             ("gfx942", 33, "iq4_xs", "q3_k", "skew", KQ, 64)]


@pytest.mark.parametrize("arch,C,fmt,down_fmt,routing,sizes,bn", HIP_CASES)
def test_emulated_hip_call(arch: str, C: int, fmt: str, down_fmt: str, routing: str, sizes: dict, bn: int) -> None:
    """The HIP body (up / down on AMD matrix cores; route, the activation quant and the combine the CUDA kernels'
    source) on the emulator with the ISA's fragment layouts, every buffer poisoned: the routing tables exact, and
    h, ybuf and out against the reference within the CUDA engine's bounds (:func:`_check_routed_call`: the same
    products, only the fp32 summation order differs)."""
    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    spec = MG.MoeGemmSpec(rows=C, fmt=fmt, down_fmt=down_fmt, bn=bn, **sizes)
    inp = _emu_inputs(spec, routing)
    with tempfile.TemporaryDirectory() as d:
        got = EMU.run(spec, inp, Path(d), arch=arch)
    _check_routed_call(spec, inp, got, routing)


def test_emulated_hip_dense_call() -> None:
    """The shared expert's dense call (Q8_0 gate / up, MXFP4 down) on gfx942's body: within the bf16 floor of the
    reference, as the CUDA call (:func:`test_emulated_dense_call`)."""
    why = EMU.host_unavailable()
    if why:
        pytest.skip(why)
    spec = MG.MoeGemmSpec(rows=77, hidden=256, inter=256, k=1, n_experts=1, fmt="q8_0", down_fmt="mxfp4", dense=True)
    inp = _emu_inputs(spec, "dense")
    with tempfile.TemporaryDirectory() as d:
        got = EMU.run(spec, inp, Path(d), arch="gfx942")
    for n, t in got.items():
        assert bool(torch.isfinite(t.float()).all()), f"{n}: unwritten (NaN poison left) elements"
    ref = MG.reference(spec, **inp)
    assert MG.rel_l2(got["out"], ref) <= 2 * BF16_ULP
    assert float((got["out"] != ref).double().mean()) <= 2 * flip_fraction_bound(spec.inter)


def test_hip_refusals_are_one_line() -> None:
    """What the HIP body does not build is a one-line RenderError naming it: K-quant weights on wave 32, 3 stages,
    the L2 prefetch, e4m3 tiles and the fp8 MMA; a Q8_0 tile of 128 rows past gfx942's 64 KiB of LDS."""
    for arch, kw, why in (("gfx1151", dict(fmt="q4_k", hidden=512, inter=512), "on wave 32"),
                          ("gfx942", dict(stages=3), "2-stage register loop"),
                          ("gfx942", dict(prefetch=128), "CUDA cp.async option"),
                          ("gfx942", dict(xfmt="e4m3"), "reads f16 activation tiles"),
                          ("gfx942", dict(xfmt="e4m3", mma="fp8"), "a CUDA instruction")):
        with pytest.raises(RenderError, match=why) as ei:
            MG.render_moe_gemm(MG.MoeGemmSpec(rows=64, **{**TINY, **kw}), target(arch))
        assert "\n" not in str(ei.value)
    with pytest.raises(RenderError, match="the limit is 65536 on hip-gfx942"):
        MG.render_moe_gemm(MG.MoeGemmSpec(rows=64, fmt="q8_0", bn=128, **{**TINY, "inter": 256}), target("gfx942"))


@pytest.mark.parametrize("arch", ["gfx942", "gfx1151"])
def test_hip_device_compile(arch: str, tmp_path: Path) -> None:
    """clang builds every kernel of an official-shape routed call (MXFP4, fused shared combine) and of the Q8_0
    shared expert for the arch with no VGPR / SGPR spills and no scratch; on gfx942 also the 43-layer file's Q3_K
    experts (Q4_K down: the two decoders with and without mins) and a Q2_K / Q6_K pair."""
    from kernel_compile import toolchain_or_skip

    toolchain_or_skip(arch)
    tgt = target(arch)
    specs = [MG.MoeGemmSpec(rows=2048, hidden=4096, inter=2048, k=6, n_experts=256, shared=True),
             MG.MoeGemmSpec(rows=2048, hidden=4096, inter=2048, k=1, n_experts=1, fmt="q8_0", dense=True)]
    if tgt.wave == 64:
        specs += [MG.MoeGemmSpec(rows=2048, hidden=4096, inter=2048, k=6, n_experts=256, fmt=f, down_fmt=df)
                  for f, df in (("q3_k", "q4_k"), ("q2_k", "q6_k"))]
    for spec in specs:
        for src in MG.render_moe_gemm(spec, tgt):
            (tmp_path / src.entry).mkdir(exist_ok=True)
            c = compile_kernel(src, tmp_path / src.entry)
            assert_no_spills(c.usage, src, c.log)


# -------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("arch", ["gfx1201", "sm_80"])
def test_unsupported_target_raises(arch: str) -> None:
    with pytest.raises(RenderError) as ei:
        MG.render_moe_gemm(MG.MoeGemmSpec(rows=64, **TINY), target(arch))
    assert "\n" not in str(ei.value) and "moe_gemm" in str(ei.value)
    with pytest.raises(RenderError, match="wgmma runs on sm_90/sm_90a only") as ei:  # Blackwell has no wgmma
        MG.render_moe_gemm(MG.MoeGemmSpec(rows=64, mma="wgmma", **TINY), target("sm_100a"))
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("kw", [dict(fmt="bf16"), dict(down_fmt="q4_k"), dict(hidden=200), dict(inter=0),
                                dict(k=0), dict(n_experts=513), dict(rows=0), dict(rows=30000), dict(act_quant=False),
                                dict(limit=float("inf")), dict(mma="wmma"), dict(mma="wgmma", fmt="q8_0"),
                                dict(mma="wgmma", down_fmt="q8_0"), dict(bn=256), dict(mma="wgmma", bn=512),
                                dict(mma="wgmma", stages=2), dict(prefetch=64), dict(prefetch=True), dict(xfmt="e5m2"),
                                dict(mma="fp8"), dict(mma="fp8", xfmt="e4m3", down_fmt="q8_0"),
                                dict(mma="wgmma", xfmt="e4m3"), dict(mma="wgmma8"),
                                dict(mma="wgmma8", xfmt="e4m3", stages=2),
                                dict(mma="wgmma8", xfmt="e4m3", bn=256, hidden=384)])
def test_bad_spec_raises(kw: dict) -> None:
    base = dict(rows=64, **TINY)
    base.update(kw)
    with pytest.raises(RenderError) as ei:
        MG.MoeGemmSpec(**base)
    assert "\n" not in str(ei.value)


def test_gpu_check_imports_on_cpu() -> None:
    m = importlib.import_module("gpu_checks.moe_gemm")
    cs = m.cases()
    # DS4C_MG_CASES: substrings, or one name exactly with a leading "="
    assert [c[0] for c in m.picked(cs, "=flash_c2048_wg_bn128")] == ["flash_c2048_wg_bn128"]
    assert {c[0] for c in m.picked(cs, "flash_c2048_wg_bn128")} == {"flash_c2048_wg_bn128", "flash_c2048_wg_bn128_cf"}
    assert len(m.picked(cs, "")) == len(cs) and m.picked(cs, "=flash_c2048_wg_bn") == []
    assert {512, 2048, 4096} <= {s.rows for _, s, _ in cs}
    name, spec, routing = next(c for c in cs if c[1].rows < 100)
    bufs = m.case_buffers(spec, torch.Generator().manual_seed(0), device="cpu", routing=routing)
    assert bufs["out"].isnan().all() and tuple(bufs["ids"].shape) == (spec.rows, spec.k)
    assert set(MG.arg_shapes(spec)) <= set(bufs)
    # the prefill lowering's two options: the dense shared-expert call at flash shapes, the fused shared combine
    name, spec, routing = next(c for c in cs if c[1].dense)
    assert (spec.hidden, spec.inter, spec.k, spec.n_experts, spec.fmt) == (4096, 2048, 1, 1, "q8_0")
    bufs = m.case_buffers(spec, torch.Generator().manual_seed(0), device="cpu", routing=routing)
    assert set(bufs) == set(MG.arg_shapes(spec)) and bufs["out"].dtype == torch.bfloat16 and bufs["out"].isnan().all()
    assert any(c[1].shared and c[1].n_experts == 256 for c in cs)
    # the 128-wide tile and the 3-stage pipeline next to their twin (same name less _bn128 / _st3, same spec but
    # bn / stages, same input seed)
    by = {n: s for n, s, _ in cs}
    var = [n for n in by if m._base(n) != n]
    assert {"flash_c2048_bn128", "flash_q3k_c2048_bn128", "flash_shexp_dense_c2048_bn128", "flash_c2048_st3",
            "flash_c2048_bn128_st3", "flash_q3k_c2048_st3", "flash_shexp_dense_c2048_st3", "flash_c2048_wg",
            "flash_shared_c2048_wg", "tiny_uneven_c77_wg", "flash_c2048_x8", "flash_q3k_c2048_x8", "flash_c2048_f8",
            "flash_c2048_bn128_f8"} <= set(var)
    assert by["flash_c2048_bn128_f8"].mma == "fp8" and by["flash_shexp_dense_c2048_x8"].xfmt == "e4m3"
    assert m._twin("flash_c2048_bn128_f8") == "flash_c2048" == m._twin("flash_c2048_x8")
    for n in var:
        twin = m._base(n)
        assert (by[n].bn == 128) == ("_bn128" in n) and (by[n].stages == 3) == ("_st3" in n)
        assert (by[n].mma == "wgmma") == ("_wg" in n) and (by[n].cols_first == n.endswith("_cf"))
        assert (by[n].prefetch > 0) == ("_pf" in n) and (by[n].xfmt == "e4m3") == n.endswith(("_x8", "_f8", "_w8"))
        assert (by[n].mma == "fp8") == n.endswith("_f8") and (by[n].mma == "wgmma8") == n.endswith("_w8")
        assert by[twin] == MG.MoeGemmSpec(**{**by[n].__dict__, "bn": 0, "stages": 0, "mma": "sync", "prefetch": 0,
                                             "cols_first": False, "xfmt": "f16"})
        assert m._seed(n) == m._seed(twin)
        # wgmma variants of width / prefetch / grid order are held to the plain wgmma case bit for bit
        want_twin = twin + "_wg" if "_wg" in n and n != twin + "_wg" else twin
        assert m._twin(n) == want_twin and want_twin in by
        assert list(by).index(want_twin) < list(by).index(n)  # the twin runs first
