"""The multi-output GEMV family (runtime/families/gemv.py, templates/gemv/gemv.cu.j2), on the CPU:

* specs with q = 1 and 5, K = 256 and 4096, every weight format (bf16 / q8_0 / mxfp4 / f32), 1 and 7 outputs,
  fp8 activation quantization on and off, the official head, and gemv_argmax render and compile for sm_90
  (nvcc, no spill stores / loads) and gfx942 / gfx1151 (clang, no spills, no scratch); skipped with the reason
  when a compiler is missing;
* the kernel signature matches ``arg_order``; the plan covers every row once and fits shared memory;
* the butterfly reduce-scatter schedule (emulated lane by lane) gives every (row, q) sum exactly once;
* the kernel's bit tricks, emulated with the same fp32 operations in numpy: the prologue's fp8 quantization
  equals ``act_quant_dequant`` bit for bit; the Q8_0 / MXFP4 decodes (aligned 4-byte reads + funnel shift, the
  2^23 magic number, the subnormal e2m1 placement with the 2^64 / 2^62 scaling) equal ``ds4c.quant.dequantize``;
* ``reference()`` agrees with an independent float64 computation (own Q8_0 / MXFP4 decoders, own fp8
  quantization) on fresh random data.

The GPU comparison is tests/gpu_checks/gemv.py.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4c.quant import act_quant_dequant, dequantize
from ds4c.runtime.families import gemv as G
from ds4c.runtime.render import KernelSource, RenderError
from ds4c.runtime.targets import target
from emulators.experts_emu import FIBERS as _FIBERS
from kernel_compile import assert_no_spills, compile_kernel
from numerics import UNIT, assert_same_roundings, fp32_order_bound, rel_l2


O = G.GemvOutput
ARCHS = ("sm_90", "gfx942", "gfx1151")


def _multi7(k: int, q: int, act_quant: bool = True) -> G.GemvSpec:
    """Attention-input fusion shape: wq_a, wkv (fp8 weights as Q8_0), compressor wkv / wgate (f32 mode),
    indexer weights_proj (bf16 mode), indexer compressor wkv / wgate (f32 mode)."""
    return G.GemvSpec(k, q, [O(1024, "q8_0", "fp8act"), O(512, "q8_0", "fp8act"), O(1024, "bf16", "f32"),
                             O(1024, "bf16", "f32"), O(64, "bf16", "bf16"), O(256, "bf16", "f32"),
                             O(256, "bf16", "f32")], act_quant)


SINGLE_MODE = {"bf16": "bf16", "f32": "f32", "q8_0": "fp8act", "mxfp4": "fp8act"}
SPECS: dict[str, G.GemvSpec] = {}
for _k in (256, 4096):
    for _q in (1, 5):
        for _f in ("bf16", "q8_0", "mxfp4", "f32"):
            SPECS[f"{_f}_k{_k}_q{_q}"] = G.GemvSpec(_k, _q, [O(1000 if _k == 256 else 2048, _f, SINGLE_MODE[_f])])
        SPECS[f"multi7_k{_k}_q{_q}"] = _multi7(_k, _q)
SPECS["multi7_k4096_q5_noaq"] = _multi7(4096, 5, act_quant=False)
SPECS["mixed_formats_k4096_q5"] = G.GemvSpec(4096, 5, [O(512, "q8_0", "fp8act"), O(2048, "mxfp4", "fp8act"),
                                                       O(300, "bf16", "bf16"), O(24, "f32", "f32", "bf16")])
SPECS["wq_b_k1024_q5"] = G.GemvSpec(1024, 5, [O(32768, "q8_0", "fp8act")])
SPECS["head_k4096_q1"] = G.GemvSpec(4096, 1, [O(129280, "bf16", "f32")])
SPECS["head_k4096_q5"] = G.GemvSpec(4096, 5, [O(129280, "bf16", "f32")])
# K-quants / IQ4_XS at official shapes (K 4096: the attention inputs, shared expert, head; K 1024: wq_b, the
# shared expert's down projection at q_lora / F widths), each format in one mode; the compile test builds these
# for every arch too
KQ_SPECS = {
    "q2_k_k4096_q1": G.GemvSpec(4096, 1, [O(1024, "q2_k", "fp8act")]),
    "q3_k_k4096_q5": G.GemvSpec(4096, 5, [O(1024, "q3_k", "fp8act"), O(512, "q3_k", "fp8act")]),
    "q4_k_k4096_q5": G.GemvSpec(4096, 5, [O(1024, "q4_k", "fp8act")]),
    "q5_k_k1024_q5": G.GemvSpec(1024, 5, [O(1024, "q5_k", "bf16")]),
    "q6_k_k1024_q5": G.GemvSpec(1024, 5, [O(4096, "q6_k", "fp8act")]),
    "q6_k_head_k4096_q1": G.GemvSpec(4096, 1, [O(129280, "q6_k", "f32")]),
    "iq4_xs_k4096_q5": G.GemvSpec(4096, 5, [O(1024, "iq4_xs", "fp8act")]),
}
SPECS.update(KQ_SPECS)


# --------------------------------------------------------------------------------------------- compiling
def _render_or_skip(name: str, arch: str) -> KernelSource:
    t = target(arch)
    try:
        return G.render_gemv(SPECS[name], t, f"gemv_{name}")
    except RenderError as e:  # only HIP may refuse, and only for shared memory
        assert t.vendor == "hip" and "shared memory" in str(e), e
        pytest.skip(f"{name} does not fit {arch}: {e}")


@pytest.fixture(scope="module")
def compiled_ahead(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The compiles of the selected ``test_render_and_compile`` cases, run two at a time (a compiler process
    per kernel, as alone; the machine's second core would otherwise idle): ``{(name, arch): future}``, each
    future's result or exception taken by its own test. Cases whose arch has no compiler are left out (their
    test compiles alone, and skips)."""
    from concurrent.futures import ThreadPoolExecutor

    from kernel_compile import compiler_missing

    if getattr(request.config, "workerinput", None) is not None:
        # under pytest-xdist the workers already keep the cores busy, and each worker's session lists every
        # item (not only the ones it will run): compiling them all ahead would repeat the other workers' work
        yield {}
        return
    wanted = [(it.callspec.params["name"], it.callspec.params["arch"]) for it in request.session.items
              if getattr(it, "originalname", "") == "test_render_and_compile" and hasattr(it, "callspec")
              and getattr(it, "module", None) is request.module]  # other files have tests of that name
    pool = ThreadPoolExecutor(2)
    out = {}
    for name, arch in wanted:
        if compiler_missing(arch):
            continue
        try:
            ks = G.render_gemv(SPECS[name], target(arch), f"gemv_{name}")
        except RenderError:
            continue
        out[name, arch] = pool.submit(compile_kernel, ks, tmp_path_factory.mktemp(f"gemv-{arch}"))
    yield out
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_render_and_compile(name: str, arch: str, tmp_path: Path, compiled_ahead: dict) -> None:
    """Every spec renders (HIP may refuse only for shared memory) and compiles without spills (the compile
    itself from :func:`compiled_ahead` when it ran it)."""
    ks = _render_or_skip(name, arch)
    assert not re.search(r"^\s*#include", ks.source, re.M)
    fut = compiled_ahead.get((name, arch))
    c = fut.result() if fut is not None else compile_kernel(ks, tmp_path)
    assert_no_spills(c.usage, ks, c.log)
    print(f"{name} {arch}: {c.usage.get('registers')} registers, {c.seconds:.2f} s")


@pytest.mark.parametrize("arch", ARCHS)
def test_argmax_compiles(arch: str, tmp_path: Path) -> None:
    for n in (129280, 1001):
        ks = G.render_argmax(G.ArgmaxSpec(n, 5), target(arch), f"gemv_argmax_{n}")
        c = compile_kernel(ks, tmp_path)
        assert_no_spills(c.usage, ks, c.log)


# --------------------------------------------------------------------------------------------- plan / API
def _signature(ks: KernelSource) -> list[str]:
    m = re.search(r"DS4C_GLOBAL void (?:DS4C_LAUNCH_BOUNDS\(\w+\)|GV_LAUNCH_BOUNDS) " + ks.entry + r"\((.*?)\)\s*\{", ks.source, re.S)
    assert m, "kernel signature not found"
    return [re.split(r"\s+", a.strip())[-1] for a in m.group(1).split(",")]


@pytest.mark.parametrize("name", ["multi7_k4096_q5", "mixed_formats_k4096_q5", "head_k4096_q1", "q3_k_k4096_q5"])
def test_signature_matches_arg_order(name: str) -> None:
    spec = SPECS[name]
    ks = G.render_gemv(spec, target("sm_90"), "gemv_sig")
    names = [a[0] for a in G.arg_order(spec)]
    assert _signature(ks) == names
    types = {"bf16": "u16", "f32": "float"}
    for j, o in enumerate(spec.outputs):
        assert f"{types[o.out_dtype]}* DS4C_RESTRICT y{j}" in ks.source


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("arch", ARCHS)
def test_plan_covers_rows_and_fits(name: str, arch: str) -> None:
    spec = SPECS[name]
    t = target(arch)
    try:
        pl = G.plan(spec, t)
    except RenderError:
        assert t.vendor == "hip"
        return
    assert pl.smem <= G.SMEM_LIMIT[t.vendor]
    toff = 0
    for o, p in zip(spec.outputs, pl.outs):
        assert p.toff == toff and p.tiles * p.rb >= o.n > (p.tiles - 1) * p.rb
        toff += p.tiles
        assert p.tg * p.g == G.THREADS and p.tg * p.nu >= p.upr and p.upr * p.uc == spec.k
        if p.staged:
            assert p.rb * p.rowbytes <= pl.stage_bytes and (p.rb * p.rowbytes) % 16 == 0
            assert pl.nch * 16 * G.THREADS >= p.rb * p.rowbytes
        assert p.sg == min(p.tg, t.wave) and p.subs * p.sg == p.tg
    assert toff == pl.total_tiles
    grid, block, smem = G.launch_shape(spec, t)
    assert 1 <= grid[0] <= pl.total_tiles and block == (256, 1, 1) and smem == pl.smem


def test_hip_reads_plain_x_from_global_when_lds_is_short() -> None:
    spec = SPECS["multi7_k4096_q5"]
    cuda, hip = G.plan(spec, target("sm_90")), G.plan(spec, target("gfx942"))
    assert cuda.p_smem and not hip.p_smem
    assert {p.xsrc for p in cuda.outs} == {"xq", "xp"} and {p.xsrc for p in hip.outs} == {"xq", "x"}
    with pytest.raises(RenderError, match="shared memory"):
        G.plan(G.GemvSpec(16384, 5, [O(64, "q8_0", "fp8act")]), target("gfx942"))


def test_bad_specs() -> None:
    with pytest.raises(RenderError):
        G.GemvSpec(100, 1, [O(8)])
    with pytest.raises(RenderError):
        G.GemvSpec(256, 0, [O(8)])
    with pytest.raises(RenderError):
        G.GemvSpec(256, 1, [])
    with pytest.raises(RenderError):
        O(8, "q7_k")
    with pytest.raises(RenderError, match="not a multiple of 256"):  # K-quant rows are whole super-blocks
        G.plan(G.GemvSpec(384, 1, [O(8, "q4_k", "fp8act")]))
    with pytest.raises(RenderError, match="not a multiple of 16"):  # 4 rows of 9 * 110 bytes: tiles off 16 B
        G.plan(G.GemvSpec(2304, 1, [O(8, "q3_k", "bf16")], rows=1))
    with pytest.raises(RenderError):
        O(8, "bf16", "fp16")
    with pytest.raises(RenderError):
        O(0)
    assert O(8, "bf16", "f32").out_dtype == "f32" and O(8, "q8_0", "fp8act").out_dtype == "bf16"


# --------------------------------------------------------------------------------------------- butterfly
@pytest.mark.parametrize("v", [1, 2, 3, 4, 5, 8, 10, 15, 20, 40])
@pytest.mark.parametrize("sg", [1, 2, 4, 8, 16, 32, 64])
def test_reduce_scatter_schedule(v: int, sg: int) -> None:
    """Emulate the rendered butterfly lane by lane: every index < v is written by exactly one lane with the sum
    over the sg lanes, nothing else is written."""
    vp, steps, nfinal, wmask = G._reduce_steps(v, sg)
    rng = np.random.default_rng(v * 100 + sg)
    vals = rng.integers(-1000, 1000, size=(sg, v)).astype(np.int64)
    acc = [list(vals[lane]) + [0] * (vp - v) for lane in range(sg)]
    base = [0] * sg
    for st in steps:
        o = st["o"]
        new = [a[:] for a in acc]
        for lane in range(sg):
            part = lane ^ o
            if st["kind"] == "half":
                h = st["h"]
                up = bool(lane & o)
                for i in range(h):
                    a, b = acc[lane][i], acc[lane][i + h]
                    pa, pb = acc[part][i], acc[part][i + h]
                    psend = pa if bool(part & o) else pb  # what the partner sends: its "up ? a : b"
                    new[lane][i] = (b if up else a) + psend
                base[lane] += h if up else 0
            else:
                for i in range(st["n"]):
                    new[lane][i] = acc[lane][i] + acc[part][i]
        acc = new
    written: dict[int, int] = {}
    for lane in range(sg):
        if lane & wmask:
            continue
        for i in range(nfinal):
            idx = base[lane] + i
            if idx < v:
                assert idx not in written, f"index {idx} written twice"
                written[idx] = acc[lane][i]
    assert sorted(written) == list(range(v))
    for idx, s in written.items():
        assert s == int(vals[:, idx].sum())
    shuffles = sum(st["h"] if st["kind"] == "half" else st["n"] for st in steps)
    assert shuffles <= max(1, v) * max(1, sg.bit_length() - 1)


# --------------------------------------------------------------------------------------------- bit tricks
F32, U32 = np.float32, np.uint32


def _f(u: np.ndarray) -> np.ndarray:
    return np.asarray(u, dtype=U32).view(F32)


def _u(f: np.ndarray) -> np.ndarray:
    return np.asarray(f, dtype=F32).view(U32)


def _round_e4m3(x: np.ndarray) -> np.ndarray:
    """prelude ds4c_round_e4m3 with the same fp32 / integer operations."""
    a = np.abs(x).astype(F32)
    sub = np.rint(a * F32(512.0)) / F32(512.0)
    u = _u(a).astype(np.uint64)
    lsb = (u >> 20) & 1
    un = ((u + 0x7FFFF + lsb) & 0xFFF00000).astype(U32)
    nrm = np.minimum(_f(un), F32(448.0))
    r = np.where(a < F32(0.015625), sub, nrm).astype(F32)
    return np.where(x < 0, -r, r).astype(F32)


def _pow2_ceil(v: np.ndarray) -> np.ndarray:
    u = _u(v)
    e, m = (u >> 23) & 0xFF, u & 0x7FFFFF
    return _f(np.where(m != 0, e + 1, e) << 23)


def _prologue_quant(x: torch.Tensor) -> torch.Tensor:
    """The kernel prologue (per 128-block of 16 lanes x 8 values), in numpy fp32."""
    xf = x.float().numpy().reshape(-1, 128).astype(F32)
    am = np.abs(xf).max(axis=1, keepdims=True)
    am = np.where(am > F32(1e-4), am, F32(1e-4)).astype(F32)
    s = _pow2_ceil((am / F32(448.0)).astype(F32))
    t = np.clip((xf / s).astype(F32), F32(-448.0), F32(448.0))
    out = (_round_e4m3(t) * s).astype(F32)
    assert np.all((_u(out) & 0xFFFF) == 0), "quantized activation not exact in bf16"
    return torch.from_numpy(out.reshape(x.shape))


def test_prologue_quantization_is_act_quant_dequant_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(11)
    parts = [torch.randn(64, 128, generator=g) * 10.0 ** torch.randint(-6, 6, (64, 1), generator=g)]
    parts.append(torch.randn(8, 128, generator=g) * 1e-7)  # amax below the 1e-4 floor
    z = torch.zeros(4, 128)
    z[1, 5] = 3.0  # a single value, exact power-of-two ratios
    z[2, :] = 448.0
    z[3, ::2] = -2.0 ** -20
    parts.append(z)
    grid = torch.arange(-4096, 4096, dtype=torch.float32).reshape(-1, 128) / 64  # many e4m3 ties
    parts.append(grid)
    x = torch.cat(parts).to(torch.bfloat16)
    got = _prologue_quant(x)
    want = act_quant_dequant(x, 128)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _words(row: np.ndarray) -> np.ndarray:
    """A stored row as little-endian u32 words (plus two zero words of slack, like the stage buffer)."""
    b = np.concatenate([row.astype(np.uint8), np.zeros(8 + (-len(row)) % 4, np.uint8)])
    return b.view("<u4").astype(np.uint64)


def _funnel(lo: np.uint64, hi: np.uint64, sh: int) -> int:
    return int((((int(hi) << 32) | int(lo)) >> sh) & 0xFFFFFFFF)


def test_q8_0_decode_matches_dequantize() -> None:
    k, n = 256, 6
    raw = G.random_weight(O(n, "q8_0", "fp8act"), k, torch.Generator().manual_seed(3)).numpy()
    want = dequantize(torch.from_numpy(raw), "Q8_0", (n, k)).numpy()
    for r in range(n):
        p = _words(raw[r])
        for unit in range(k // 16):
            b = unit >> 1
            qo = 34 * b + 2 + 16 * (unit & 1)
            wi, sh = qo >> 2, (qo & 3) * 8
            so = 34 * b
            d16 = (int(p[so >> 2]) >> ((so & 3) * 8)) & 0xFFFF
            d = np.array([d16], np.uint16).view(np.float16).astype(F32)[0]
            for i in range(4):
                w = _funnel(p[wi + i], p[wi + i + 1], sh) ^ 0x80808080
                for j in range(4):
                    byte = (w >> (8 * j)) & 0xFF
                    q = _f(np.array([0x4B000000 | byte]))[0] - F32(8388736.0)
                    assert q * d == want[r, unit * 16 + 4 * i + j]


def test_mxfp4_decode_matches_dequantize() -> None:
    k, n = 256, 4
    out = O(n, "mxfp4", "fp8act")
    raw = G.random_weight(out, k, torch.Generator().manual_seed(5)).numpy()
    raw[0, :17] = np.arange(17, dtype=np.uint8) * 15  # every code, e = 0 (the subnormal scale)
    raw[1, 17] = 254
    want = dequantize(torch.from_numpy(raw), "MXFP4", (n, k)).numpy().astype(np.float64)
    for r in range(n):
        p = _words(raw[r])
        for unit in range(k // 32):
            off = 17 * unit
            wi, sh = off >> 2, (off & 3) * 8
            e = (int(p[wi]) >> sh) & 0xFF
            qs = [_funnel(p[wi + i], p[wi + i + 1], sh + 8) for i in range(4)]
            for c in range(4):
                for i in range(8):
                    t = qs[(c & 1) * 2 + (i >> 2)] >> (8 * (i & 3) + 4 * (c >> 1))
                    fb = ((t & 7) << 22) | ((t & 8) << 28)
                    w = _f(np.array([fb]))[0]  # e2m1 * 2^-126 (subnormal for |e2m1| < 1)
                    # kernel (fp32): (x * 2^64) * w summed, then * 2^62, then * e8m0(e); here with x = 1
                    sc = _f(np.array([e << 23 if e else 0x00400000]))[0]
                    with np.errstate(over="ignore"):
                        val = (F32(2.0 ** 64) * w) * F32(2.0 ** 62) * sc
                    assert val == want[r, unit * 32 + 8 * c + i], (r, unit, c, i)


# --------------------------------------------------------------------------------------------- reference
def _own_dequant(o: G.GemvOutput, k: int, raw: torch.Tensor) -> np.ndarray:
    """Independent float64 decoders of the stored layouts (spec gguf-deepseek4.md)."""
    a = raw.contiguous().view(torch.uint8).numpy().reshape(o.n, -1)
    if o.fmt == "bf16":
        return (a.view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(o.n, k)
    if o.fmt == "f32":
        return a.view("<f4").astype(np.float64).reshape(o.n, k)
    if o.fmt == "q8_0":
        blk = a.reshape(o.n, k // 32, 34)
        d = blk[..., :2].copy().view("<f2").astype(np.float64)
        q = blk[..., 2:].view(np.int8).astype(np.float64)
        return (q * d).reshape(o.n, k)
    blk = a.reshape(o.n, k // 32, 17)
    e = blk[..., 0].astype(np.float64)
    qs = blk[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes & 7]
    val = np.where(codes & 8, -mag, mag)
    return (val * np.exp2(e - 127)[..., None]).reshape(o.n, k)


def _own_act_quant(x: torch.Tensor) -> np.ndarray:
    xb = x.double().numpy().reshape(-1, 128)
    out = np.empty_like(xb)
    for i, blk in enumerate(xb):
        amax = max(float(np.abs(blk).max()), float(np.float32(1e-4)))
        m, e = math.frexp(float(np.float32(amax) / np.float32(448.0)))
        s = 2.0 ** (e - 1 if m == 0.5 else e)
        q = torch.from_numpy(np.clip(blk / s, -448, 448)).to(torch.float8_e4m3fn).double().numpy()
        out[i] = q * s
    return out.reshape(x.shape)


@pytest.mark.parametrize("name", ["mixed_formats_k4096_q5", "multi7_k256_q5", "multi7_k4096_q5_noaq",
                                  "q8_0_k256_q1", "mxfp4_k256_q5", "f32_k256_q1"])
def test_reference_against_float64(name: str) -> None:
    spec = SPECS[name]
    g = torch.Generator().manual_seed(hash(name) % 1000)
    x = (torch.randn(spec.q, spec.k, generator=g) * 2.0).to(torch.bfloat16)
    ws = [G.random_weight(o, spec.k, g) for o in spec.outputs]
    got = G.reference(spec, x, ws)
    xq = _own_act_quant(x)
    xp = x.double().numpy()
    for o, w, y in zip(spec.outputs, ws, got):
        assert y.shape == (spec.q, o.n) and y.dtype == o.torch_out_dtype
        xa = xq if (o.mode == "fp8act" and spec.act_quant) else xp
        want = xa @ _own_dequant(o, spec.k, w).T
        err = np.linalg.norm(y.double().numpy() - want) / np.linalg.norm(want)
        # the fp32 product of K terms is within K 2^-24 of the exact one; a bf16 output adds one rounding
        # (unit roundoff 2^-8 per element, so also in relative L2)
        bound = fp32_order_bound(spec.k) + (UNIT[torch.bfloat16] if o.out_dtype == "bf16" else 0.0)
        assert err <= bound, (o, err, bound)


def test_random_weight_layouts() -> None:
    g = torch.Generator().manual_seed(0)
    for f in G.FORMATS:
        o = O(5, f, "f32")
        w = G.random_weight(o, 256, g)
        shape, dt = G.weight_shape(o, 256)
        assert tuple(w.shape) == shape and w.dtype == dt
        v = G.dequantize_weight(o, 256, w)
        assert torch.isfinite(v).all() and v.abs().max() > 0
    raw = G.random_weight(O(64, "mxfp4"), 256, g)
    e = raw.view(64, 8, 17)[..., 0]
    assert int(e.min()) >= 118 and int(e.max()) <= 124


def test_argmax_reference_ties_and_nan() -> None:
    t = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("nan"), 1.0, float("nan"), 5.0], [-1.0, -1.0, -2.0, -3.0]])
    assert G.argmax_reference(t).tolist() == [1, 0, 0]
    ks = G.render_argmax(G.ArgmaxSpec(4, 3), target("sm_90"), "am")
    assert G.argmax_launch_shape(G.ArgmaxSpec(4, 3)) == ((3, 1, 1), (1024, 1, 1), 0)
    assert "am(const float* DS4C_RESTRICT logits, i32* DS4C_RESTRICT out)" in ks.source


# --------------------------------------------------------------------------------------------- CPU execution
# The rendered kernel body, unchanged, run on the CPU: a test-only prelude maps every GPU thread of a block to
# a fiber (emulators/experts_emu.py's FIBERS: one OS thread, a fiber runs until it waits at a barrier), ds4c_sync to
# a barrier of the block, and ds4c_shfl_xor to an exchange through a per-warp buffer between two warp barriers;
# blocks of the (persistent) grid run one after the other with shared memory refilled with 0xff bytes (NaN)
# before each. Wave 32 (the CUDA plan) and wave 64 (the gfx942 plan) are both
# run, so the HIP build's reductions and tiling are executed too. Arithmetic is IEEE fp32 without contraction,
# so results match the GPU's to fp32 rounding (the GPU fuses multiply-adds), not bit for bit.
_CPU_PRELUDE = r"""// ---- test-only CPU prelude (tests/test_gemv_family.py)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <ucontext.h>
{% raw %}""" + _FIBERS + r"""{% endraw %}
#define DS4C_CPU 1
#define DS4C_WAVE {{ wave }}
#define DS4C_GLOBAL extern "C"
#define DS4C_PDL_ENTRY() do { } while (0)  /* programmatic dependent launch: nothing to wait for on the host */
#define DS4C_DEVICE static inline
#define DS4C_SHARED static
#define DS4C_RESTRICT __restrict__
#define DS4C_LAUNCH_BOUNDS(n)
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;
#define DS4C_HAS_BYTE_PERM 1  /* prmt on the host: byte (sel >> 4i) & 7 of (b:a), as prelude/cuda.h.j2 */
static inline u32 ds4c_byte_perm(u32 a, u32 b, u32 sel) {
  const unsigned long long v = ((unsigned long long)b << 32) | a;
  u32 r = 0u;
  for (int i = 0; i < 4; ++i) r |= (u32)((v >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}
struct ds4c_emu_state { int nblk; EmuBarrier* block; EmuBarrier* warp[64]; u32 xbuf[64][64]; };
static ds4c_emu_state ds4c_emu;
static int ds4c_emu_bid;
#define ds4c_emu_tid emu_cur
alignas(16) static unsigned char ds4c_emu_smem[{{ emu_smem }}];
DS4C_DEVICE int ds4c_tid() { return ds4c_emu_tid; }
DS4C_DEVICE int ds4c_bid_x() { return ds4c_emu_bid; }
DS4C_DEVICE int ds4c_bid_y() { return 0; }
DS4C_DEVICE int ds4c_nblk_x() { return ds4c_emu.nblk; }
DS4C_DEVICE int ds4c_lane() { return ds4c_emu_tid & (DS4C_WAVE - 1); }
DS4C_DEVICE void ds4c_sync() { ds4c_emu.block->arrive_and_wait(); }
DS4C_DEVICE float ds4c_as_float(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }
DS4C_DEVICE u32 ds4c_as_u32(float f) { u32 b; std::memcpy(&b, &f, 4); return b; }
DS4C_DEVICE u32 ds4c_emu_xchg(u32 v, int mask) {
  const int w = ds4c_emu_tid / DS4C_WAVE, l = ds4c_lane();
  ds4c_emu.xbuf[w][l] = v;
  ds4c_emu.warp[w]->arrive_and_wait();
  const u32 r = ds4c_emu.xbuf[w][l ^ mask];
  ds4c_emu.warp[w]->arrive_and_wait();
  return r;
}
DS4C_DEVICE float ds4c_shfl_xor(float v, int mask) { return ds4c_as_float(ds4c_emu_xchg(ds4c_as_u32(v), mask)); }
DS4C_DEVICE int ds4c_shfl_xor_i(int v, int mask) { return (int)ds4c_emu_xchg((u32)v, mask); }
DS4C_DEVICE float ds4c_exp(float x) { return std::exp(x); }
DS4C_DEVICE float ds4c_rint(float x) { return std::nearbyint(x); }
DS4C_DEVICE float ds4c_log1p(float x) { return std::log1p(x); }
DS4C_DEVICE float ds4c_sqrt(float x) { return std::sqrt(x); }
DS4C_DEVICE float ds4c_rsqrt(float x) { return 1.0f / std::sqrt(x); }
DS4C_DEVICE float ds4c_cos(float x) { return std::cos(x); }
DS4C_DEVICE float ds4c_sin(float x) { return std::sin(x); }
"""

_CTYPES = {"u16": "const u16*", "u8": "const u8*", "float": "const float*"}


def _emu_source(ks_text: str, entry: str, argtypes: list[str], wave: int) -> str:
    body = ks_text.replace("extern DS4C_SHARED gv_v4 gv_smem[];", "gv_v4* const gv_smem = (gv_v4*)ds4c_emu_smem;")
    call = ", ".join(f"({t})a[{i}]" for i, t in enumerate(argtypes))
    return body + f"""
extern "C" void emu_launch(int grid, int threads, void** a) {{
  ds4c_emu.nblk = grid;
  EmuBarrier bb(threads);
  ds4c_emu.block = &bb;
  std::vector<EmuBarrier> wb(threads / DS4C_WAVE, EmuBarrier(DS4C_WAVE));
  for (int w = 0; w < threads / DS4C_WAVE; ++w) ds4c_emu.warp[w] = &wb[w];
  for (int b = 0; b < grid; ++b) {{
    std::memset(ds4c_emu_smem, 0xff, sizeof ds4c_emu_smem);
    ds4c_emu_bid = b;
    auto body = [&](int) {{ {entry}({call}); }};
    emu_run_fibers(threads, body);
  }}
}}
"""


def _emu_render(template_params: dict, wave: int, emu_smem: int, name: str) -> str:
    import jinja2

    from ds4c.runtime.render import TEMPLATE_DIR

    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader([jinja2.DictLoader({"prelude/cpu.h.j2": _CPU_PRELUDE}),
                                   jinja2.FileSystemLoader(str(TEMPLATE_DIR))]),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    return env.get_template(G.TEMPLATE).render(**template_params, vendor="cpu", wave=wave, entry=name,
                                               emu_smem=max(16, emu_smem))


def _emu_build(src: str, workdir: Path) -> "ctypes.CDLL":
    import ctypes

    cxx = shutil.which("g++") or shutil.which("clang++-19") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++20 compiler (g++ / clang++) for the CPU execution of the kernel")
    (workdir / "emu.cpp").write_text(src)
    # -Og: half the compile time of -O1 and about its speed for these 3-block grids (the compile is most of a case)
    p = subprocess.run([cxx, "-std=c++20", "-Og", "-shared", "-fPIC", "-ffp-contract=off", "-w",
                        "-o", "emu.so", "emu.cpp"], cwd=workdir, capture_output=True, text=True)
    if p.returncode and "ucontext" in p.stderr and "No such file" in p.stderr:
        pytest.skip(f"no <ucontext.h> for {cxx} (the CPU execution's fibers)")
    assert p.returncode == 0, p.stderr[-4000:]
    return ctypes.CDLL(str(workdir / "emu.so"))


def _emu_run(lib, grid: int, threads: int, tensors: list[torch.Tensor]) -> None:
    import ctypes

    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    lib.emu_launch(ctypes.c_int(grid), ctypes.c_int(threads), ptrs)


EMU_SPECS = {
    "mixed_k256_q5_r4": G.GemvSpec(256, 5, [O(70, "q8_0", "fp8act"), O(45, "mxfp4", "fp8act"), O(33, "bf16", "bf16"),
                                            O(29, "f32", "f32"), O(21, "bf16", "fp8act", "f32")], rows=4),
    "mixed_k256_q2_auto": G.GemvSpec(256, 2, [O(70, "q8_0", "fp8act"), O(45, "mxfp4", "fp8act", "f32"),
                                              O(33, "bf16", "f32")]),
    "k1024_q3_r2": G.GemvSpec(1024, 3, [O(37, "q8_0", "fp8act", "f32"), O(19, "mxfp4", "fp8act"),
                                        O(23, "f32", "bf16", "f32")], rows=2),
    "k4096_q5_r4": G.GemvSpec(4096, 5, [O(9, "q8_0", "fp8act"), O(9, "mxfp4", "fp8act", "f32"), O(5, "bf16", "f32")],
                              rows=4),
    "k4096_q1_noaq": G.GemvSpec(4096, 1, [O(7, "q8_0", "fp8act", "f32"), O(11, "mxfp4", "fp8act")], act_quant=False),
    "interleaved_k256_q3_r2": G.GemvSpec(256, 3, [O(40, "bf16", "bf16"), O(50, "q8_0", "fp8act", "f32"),
                                                  O(9, "f32", "f32"), O(20, "mxfp4", "fp8act"),
                                                  O(70, "bf16", "fp8act", "f32")], rows=2),
    "k384_q4_r8": G.GemvSpec(384, 4, [O(17, "q8_0", "fp8act", "f32"), O(13, "mxfp4", "fp8act", "f32"),
                                      O(11, "bf16", "bf16", "f32")], rows=8),
    # a lanes step's 16 rows in one pass (DS4C_GEMV_ROWS=16)
    "lanes_k512_q16": G.GemvSpec(512, 16, [O(21, "q8_0", "fp8act"), O(13, "mxfp4", "fp8act", "f32"),
                                           O(11, "bf16", "bf16"), O(9, "q4_k", "fp8act")]),
}
# K-quants and IQ4_XS (one spec per format; both modes with the FP8 prologue and plain x, q 1 and 5; Q3_K / Q6_K
# rows of 1 and 3 super-blocks (110 / 330, 210 / 630 bytes) are not 4-byte multiples; partial last tiles)
KQ_EMU_SPECS = {
    "q2_k_k512_q5": G.GemvSpec(512, 5, [O(37, "q2_k", "fp8act"), O(11, "q2_k", "bf16", "f32")]),
    "q3_k_k768_q5_r2": G.GemvSpec(768, 5, [O(30, "q3_k", "fp8act", "f32"), O(9, "q3_k", "f32")], rows=2),
    "q4_k_k1024_q1": G.GemvSpec(1024, 1, [O(45, "q4_k", "fp8act"), O(20, "q4_k", "bf16", "f32")]),
    "q5_k_k256_q5_r4": G.GemvSpec(256, 5, [O(70, "q5_k", "fp8act", "f32"), O(33, "bf16", "bf16")], rows=4),
    "q6_k_k256_q1_noaq": G.GemvSpec(256, 1, [O(50, "q6_k", "fp8act", "f32"), O(24, "q6_k", "bf16")],
                                    act_quant=False),
    "iq4_xs_k512_q5": G.GemvSpec(512, 5, [O(29, "iq4_xs", "fp8act"), O(40, "iq4_xs", "f32")]),
    "kq_mixed_k256_q3": G.GemvSpec(256, 3, [O(21, "q6_k", "fp8act", "f32"), O(17, "q8_0", "fp8act", "f32"),
                                            O(19, "q3_k", "bf16", "f32"), O(13, "mxfp4", "fp8act", "f32")]),
}
EMU_SPECS.update(KQ_EMU_SPECS)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
@pytest.mark.parametrize("name", sorted(EMU_SPECS))
def test_kernel_executes_on_cpu(name: str, arch: str, tmp_path: Path) -> None:
    """The rendered kernel (CUDA plan, wave 32; gfx942 plan, wave 64), executed on the CPU, against
    ``reference()`` on fresh random data, every output element written over NaN poison; the grid is small
    (3 blocks) so blocks walk several tiles and the register prefetch of the next tile is exercised."""
    spec = EMU_SPECS[name]
    t = target(arch)
    try:
        pl = G.plan(spec, t)
    except RenderError as e:
        pytest.skip(str(e))
    params = G._plan_params(pl)
    entry = f"emu_{name}"
    src = _emu_render(params, t.wave, pl.smem, entry)
    argtypes = ["const u16*"] + [_CTYPES[o["wtype"]] for o in params["outs"]] + \
               [("u16*" if o["ytype"] == "u16" else "float*") for o in params["outs"]]
    lib = _emu_build(_emu_source(src, entry, argtypes, t.wave), tmp_path)
    g = torch.Generator().manual_seed(len(name) * 7 + t.wave)
    mag = 10.0 ** (torch.rand(spec.q, spec.k // 128, 1, generator=g) * 4 - 2)
    if spec.q > 1:
        mag[1] = 1e-6  # a row whose every 128-block has amax below the 1e-4 floor of the scale
    x = (torch.randn(spec.q, spec.k // 128, 128, generator=g) * mag).reshape(spec.q, spec.k).to(torch.bfloat16)
    ws = [G.random_weight(o, spec.k, g) for o in spec.outputs]
    ys = [torch.full((spec.q, o.n), float("nan"), dtype=o.torch_out_dtype) for o in spec.outputs]
    grid = min(3, pl.total_tiles)
    _emu_run(lib, grid, G.THREADS, [x, *ws, *ys])
    want = G.reference(spec, x, ws)
    for o, y, ref in zip(spec.outputs, ys, want):
        assert not torch.isnan(y).any(), f"{o}: unwritten outputs"
        if o.out_dtype == "bf16":  # the same products in another fp32 order: one rounding apart
            assert_same_roundings(y, ref, k=spec.k, what=str(o))
        else:
            assert rel_l2(y, ref, dim=1) <= fp32_order_bound(spec.k), o


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_argmax_executes_on_cpu(arch: str, tmp_path: Path) -> None:
    t = target(arch)
    n, q = 3001, 4
    params = {"kind": "argmax", "n": n, "q": q, "threads": G.ARGMAX_THREADS}
    src = _emu_render(params, t.wave, 16, "emu_argmax")
    lib = _emu_build(_emu_source(src, "emu_argmax", ["const float*", "i32*"], t.wave), tmp_path)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(q, n, generator=g)
    logits[1, 2999] = logits[1, 17] = 50.0  # tie: the lower index wins
    logits[2, 1234] = float("nan")  # NaN is the maximum
    logits[3] = -float("inf")  # all equal: index 0
    out = torch.full((q,), -1, dtype=torch.int32)
    _emu_run(lib, q, G.ARGMAX_THREADS, [logits, out])
    assert out.tolist() == G.argmax_reference(logits).tolist() == [int(logits[0].argmax()), 17, 1234, 0]
