"""The indexer top-k and router kernel families (runtime/families/{indexer,router}.py, templates/indexer/,
templates/router/): rendering at the official and tiny shapes, q = 1 and 5; device compiles for sm_90 (no
spills), gfx942 and gfx1151 (skipped with a reason when a compiler is missing); and the CPU references the GPU
checks compare against, checked against ds4c.reference and the IR's ops, with deliberate ties. The select
stage's algorithm (radix threshold, id-order compaction, rank placement) is also run step by step on the CPU
(``indexer.kernel_select``) against torch's stable sort on tie-heavy scores with +-0, +-inf and NaN."""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ds4c.ir.ops import IndexerTopk, Route, RouterScores, SpanMask
from ds4c.reference import blocks as B
from ds4c.reference import primitives as P
from ds4c.runtime.families import indexer as I
from ds4c.runtime.families import router as R
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from emulators.experts_emu import FIBERS as _FIBERS
from kernel_compile import compile_kernel, toolchain_or_skip


BF16 = torch.bfloat16
ARCHS = ["sm_90", "gfx942", "gfx1151"]

IX_OFFICIAL = dict(heads=64, dim=128, topk=512)
IX_TINY = dict(heads=4, dim=128, topk=8)
IX_CASES = [("official", IX_OFFICIAL, cap, q) for cap in (1024, 16384) for q in (1, 5)] + \
           [("tiny", IX_TINY, cap, q) for cap in (64, 1000) for q in (1, 5)]
RT_CASES = [(shape, dict(experts=E, k=k), h, q) for shape, E, k in (("official", 256, 6), ("tiny", 16, 4))
            for h in (False, True) for q in (1, 5)]


def _ix(case: tuple) -> I.IndexerSpec:
    _, base, cap, q = case
    return I.IndexerSpec(q=q, cap=cap, **base)


def _rt(case: tuple) -> R.RouterSpec:
    _, base, h, q = case
    return R.RouterSpec(q=q, hash=h, **base)


def _ix_id(c: tuple) -> str:
    return f"{c[0]}-cap{c[2]}-q{c[3]}"


def _rt_id(c: tuple) -> str:
    return f"{c[0]}-{'hash' if c[2] else 'topk'}-q{c[3]}"


def _sig_names(src: str, entry: str) -> list[str]:
    sig = src.split(f"{entry}(", 1)[1].split(")", 1)[0]
    return re.findall(r"(\w+)\s*(?:,|$)", sig.replace("\n", " "))


# ------------------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("case", IX_CASES, ids=_ix_id)
@pytest.mark.parametrize("arch", ARCHS)
def test_render_indexer(case: tuple, arch: str) -> None:
    spec, t = _ix(case), target(arch)
    ks = I.render_indexer(spec, t)
    assert [k.name.rsplit("_", 1)[1] for k in ks] == ["scores", "select"]
    names = I.arg_names(spec)
    for k, stage in zip(ks, I.STAGES):
        assert k.family == "indexer" and not re.search(r"^\s*#include", k.source, re.M)
        assert _sig_names(k.source, k.entry) == names[stage]
        assert "prelude/common.h.j2" in k.templates and f"prelude/{t.vendor}.h.j2" in k.templates
    # q is not part of the kernels: every width shares them
    other = I.render_indexer(I.IndexerSpec(**{**spec.__dict__, "q": 6 - spec.q}), t)
    assert [k.source for k in other] == [k.source for k in ks]
    ls, lsel = I.launch_shapes(spec)
    assert ls.grid == (-(-spec.cap // spec.kt), spec.q, 1) and lsel.grid == (spec.q, 1, 1)
    assert ls.block[0] % 64 == 0 and lsel.block[0] % t.wave == 0
    assert lsel.block[0] * spec.ept >= spec.cap
    assert spec.scores_smem_bytes() <= I.STATIC_SMEM_LIMIT and spec.select_smem_bytes() <= I.STATIC_SMEM_LIMIT
    shapes = I.arg_shapes(spec)
    assert shapes["out"][0] == (spec.q, min(spec.topk, spec.cap)) and shapes["scores"][0] == (spec.q, spec.cap)


def test_indexer_official_geometry() -> None:
    s = I.IndexerSpec(q=5, cap=16384)
    assert (s.kt, s.th, s.scores_threads, s.d_chunk, s.n_tiles) == (64, 8, 128, 64, 256)
    assert (s.select_block(), s.ept, s.rank_split, s.vec, s.kout) == (1024, 16, 2, True, 512)
    s = I.IndexerSpec(q=1, cap=1024)
    assert (s.select_block(), s.ept, s.rank_split, s.vec) == (1024, 2, 2, False)
    t = I.IndexerSpec(q=1, cap=64, heads=4, topk=8)
    assert (t.kt, t.th, t.scores_threads, t.kout) == (256, 4, 64, 8)


@pytest.mark.parametrize("case", RT_CASES, ids=_rt_id)
@pytest.mark.parametrize("arch", ARCHS)
def test_render_router(case: tuple, arch: str) -> None:
    spec, t = _rt(case), target(arch)
    (k,) = R.render_router(spec, t)
    assert k.family == "router" and not re.search(r"^\s*#include", k.source, re.M)
    assert _sig_names(k.source, k.entry) == R.arg_names(spec)["route"]
    assert ("const i64* DS4C_RESTRICT table" in k.source) == spec.hash
    assert "RT_SCALE 0x1.8000000000000p+0f" in k.source
    (ln,) = R.launch_shapes(spec)
    assert ln.grid == (spec.q, 1, 1) and ln.block[0] % t.wave == 0 and ln.block[0] >= min(spec.experts, 1024)


def test_spec_validation() -> None:
    with pytest.raises(RenderError, match="heads"):
        I.IndexerSpec(q=1, heads=6)
    with pytest.raises(RenderError, match="cap"):
        I.IndexerSpec(q=1, cap=40000)
    with pytest.raises(RenderError, match="dim"):
        I.IndexerSpec(q=1, dim=100)
    with pytest.raises(RenderError, match="select_threads"):
        I.IndexerSpec(q=1, select_threads=96)
    with pytest.raises(RenderError, match="shared memory"):
        I.IndexerSpec(q=1, topk=16384, cap=16384)
    with pytest.raises(RenderError, match="k 0"):
        R.RouterSpec(q=1, k=0)
    with pytest.raises(RenderError, match="threads"):
        R.RouterSpec(q=1, threads=100)
    assert R.render_router(R.RouterSpec(q=1, experts=16, k=4, threads=64), target("gfx942"))


# ------------------------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("arch", ARCHS)
def test_compile_all(arch: str, tmp_path: Path) -> None:
    """Every indexer and router kernel (official and tiny; q does not change the kernels) compiles; no spills,
    no scratch, static shared memory under 48 KiB."""
    toolchain_or_skip(arch)
    t = target(arch)
    srcs = {}
    for c in IX_CASES:
        for k in I.render_indexer(_ix(c), t):
            srcs[k.entry] = k
    for c in RT_CASES:
        for k in R.render_router(_rt(c), t):
            srcs[k.entry] = k
    for k in R.render_router(R.RouterSpec(q=1, from_logits=False), t):
        srcs[k.entry] = k

    def job(k):
        d = tmp_path / k.entry
        d.mkdir()
        return k.entry, compile_kernel(k, d, require_usage=False)

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(job, srcs.values()))
    report = []
    for entry, c in results:
        log, use = c.log, {**c.usage, "seconds": c.seconds}
        report.append(f"{entry}: {use.get('registers')} regs, {use.get('smem_bytes')} B smem, "
                      f"{use.get('seconds', 0):.2f} s")
        assert use.get("smem_bytes", 0) <= 48 * 1024, f"{entry}: {use}"
        if t.vendor == "cuda":
            assert not use.get("spills", False), f"{entry} on {arch} spills: {use}\n{log}"
            assert "0 bytes spill stores" in log and "bytes stack frame, 0 bytes spill" in log, log
            assert use.get("stack_bytes", 0) == 0, f"{entry} on {arch} uses a stack frame: {use}"
        else:  # AMDGPU: no VGPR spills and no scratch
            assert use.get("vgpr_spills", 0) == 0, f"{entry} on {arch} spills VGPRs: {use}\n{log}"
            assert use.get("scratch_bytes", 0) == 0, f"{entry} on {arch} uses scratch: {use}\n{log}"
    print(f"\n[{arch}]\n" + "\n".join(report))


# ---------------------------------------------------------------------------------------------- indexer reference
def _ir_indexer(spec: I.IndexerSpec, inp: dict) -> torch.Tensor:
    """The IR's ops: span_mask (positions, live) then indexer_topk."""
    span = torch.zeros(spec.cap, 1)
    (mask,) = SpanMask.run(None, [span, inp["positions"], inp["live"]], {"ratio": spec.ratio})
    (sel,) = IndexerTopk.run(None, [inp["qi"], inp["keys"], inp["hw"], mask], {"topk": spec.topk})
    return sel


IX_REF_CASES = [
    # (spec kwargs, input kwargs): full rows (threshold search), nvalid < topk (padding), first rows
    # (nvalid 0 and 1), a live length below the causal limit
    (dict(IX_OFFICIAL, cap=1024, q=5), {}),
    (dict(IX_OFFICIAL, cap=1024, q=5), {"pos": 4 * 300 - 2}),
    (dict(IX_OFFICIAL, cap=1024, q=5), {"pos": 0}),
    (dict(IX_OFFICIAL, cap=1024, q=1), {"pos": 4 * 2000, "live": 700}),
    (dict(IX_TINY, cap=64, q=5), {}),
    (dict(IX_TINY, cap=64, q=1), {"pos": 9}),
    (dict(IX_TINY, cap=1000, q=5), {"pos": 400, "live": 5}),
]


@pytest.mark.parametrize("sk,ik", IX_REF_CASES, ids=[f"{i}" for i in range(len(IX_REF_CASES))])
def test_indexer_reference(sk: dict, ik: dict) -> None:
    """reference() == ds4c.reference (index_scores, indexer_select) == the IR's span_mask + indexer_topk; the
    scores stage's CPU model is bit-exact on these (FP4) inputs and the select model gives the same ids."""
    spec = I.IndexerSpec(**sk)
    inp = I.random_inputs(spec, torch.Generator().manual_seed(11), **ik)
    ref = I.reference(spec, **inp)
    n = I.nvalid(spec, inp["positions"], inp["live"])
    assert ref["out"].shape == (spec.q, spec.kout) and ref["out"].dtype == torch.int64
    assert torch.equal(ref["out"], _ir_indexer(spec, inp))
    for i in range(spec.q):
        valid = torch.arange(spec.cap) < n[i]
        assert torch.equal(ref["scores"][i], P.index_scores(inp["qi"][i], inp["keys"], inp["hw"][i], valid))
        row = ref["out"][i]
        m = min(spec.topk, n[i])
        assert bool((row[m:] == -1).all()) and bool((row[:m] >= 0).all()) and bool((row[:m] < n[i]).all())
        s = ref["scores"][i].float()[row[:m]]
        assert bool((s[:-1] >= s[1:]).all())  # descending
        same = s[:-1] == s[1:]
        assert bool((row[:m][:-1][same] < row[:m][1:][same]).all())  # ties: lower id first
    ks = I.kernel_scores(spec, **inp)
    assert torch.equal(ks.view(torch.int16), ref["scores"].view(torch.int16))
    assert torch.equal(I.kernel_select(spec, ref["scores"], inp["positions"], inp["live"]), ref["out"])


def test_indexer_ties_cross_the_cut() -> None:
    """The random inputs do put exact ties across the top-k cut (so the GPU check exercises the tie rule), and
    the lower ids win them."""
    spec = I.IndexerSpec(q=5, cap=1024, **IX_OFFICIAL)
    inp = I.random_inputs(spec, torch.Generator().manual_seed(3))
    ref = I.reference(spec, **inp)
    crossed = 0
    for i in range(spec.q):
        sc = ref["scores"][i].float()
        sel = ref["out"][i]
        cut = sc[sel[-1]]
        tied = (sc == cut).nonzero().flatten()
        chosen = set(sel.tolist())
        if any(int(j) not in chosen for j in tied):
            crossed += 1
            inside = sorted(int(j) for j in tied if int(j) in chosen)
            outside = sorted(int(j) for j in tied if int(j) not in chosen)
            assert max(inside) < min(outside)
    assert crossed >= 1


def test_indexer_kernel_scores_exact_for_fp4_inputs() -> None:
    """The claim behind exact GPU ids: with FP4 qi and keys every fp32 partial sum of a dot product is exact,
    so the order of summation does not matter (fp64 sums agree with the fp32 ones)."""
    spec = I.IndexerSpec(q=1, cap=256, **IX_OFFICIAL)
    inp = I.random_inputs(spec, torch.Generator().manual_seed(5))
    q, k = inp["qi"][0].double(), inp["keys"].double()
    d64 = q @ k.T
    d32 = inp["qi"][0].float() @ inp["keys"].float().T
    assert torch.equal(d64.float().double(), d64)
    assert torch.equal(d32.double(), d64)


def _expected_select(scores: torch.Tensor, n: list[int], topk: int) -> torch.Tensor:
    out = torch.full((scores.shape[0], min(topk, scores.shape[1])), -1, dtype=torch.int64)
    for i, ni in enumerate(n):
        sel = P.topk_lower_index(scores[i], out.shape[1])
        m = min(topk, ni)
        out[i, :m] = sel[:m]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_select_model_tie_heavy(seed: int) -> None:
    """The select algorithm (kernel_select) == torch's stable descending sort + -1 padding on scores drawn
    from a handful of values (massive ties), with +-0, +-inf and NaN among them."""
    g = torch.Generator().manual_seed(seed)
    cap, topk, q = (1000, 64, 5) if seed % 2 else (300, 300, 3)
    spec = I.IndexerSpec(q=q, heads=4, dim=128, topk=topk, cap=cap)
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, float("inf"), float("-inf"), float("nan"), 3.0e-3,
                         -7.0, 65504.0])
    scores = pool[torch.randint(pool.numel() if seed > 1 else 6, (q, cap), generator=g)].to(BF16)
    positions = torch.tensor([4 * cap - 1, 4 * cap, 4 * (cap // 3), 4 * topk + 3, 7][:q], dtype=torch.int64)
    live = torch.tensor([cap - seed], dtype=torch.int64)
    n = I.nvalid(spec, positions, live)
    for i, ni in enumerate(n):
        scores[i, ni:] = float("-inf")  # what the scores stage writes past nvalid
    got = I.kernel_select(spec, scores, positions, live)
    assert torch.equal(got, _expected_select(scores, n, topk))


def test_select_model_hand_example() -> None:
    spec = I.IndexerSpec(q=1, heads=4, dim=128, topk=3, cap=8)
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -0.0, 0.0, 9.0]]).to(BF16)
    # row sees 7 keys (pos 27 -> 28 // 4 = 7): key 7 (9.0) is masked
    got = I.kernel_select(spec, scores, torch.tensor([27]), torch.tensor([8]))
    assert got.tolist() == [[1, 2, 4]]
    spec = I.IndexerSpec(q=1, heads=4, dim=128, topk=5, cap=8)
    got = I.kernel_select(spec, scores, torch.tensor([11]), torch.tensor([8]))  # 3 visible keys
    assert got.tolist() == [[1, 2, 0, -1, -1]]
    got = I.kernel_select(spec, torch.tensor([[-0.0, 0.0, -1.0, 0.0, -0.0, 1.0]]).to(BF16), torch.tensor([23]),
                          torch.tensor([6]))
    assert got.tolist() == [[5, 0, 1, 3, 4]]  # -0 == +0: ties by id


# ----------------------------------------------------------------------------------------------- router reference
@pytest.mark.parametrize("case", RT_CASES, ids=_rt_id)
def test_router_reference(case: tuple) -> None:
    """reference() == sqrtsoftplus + route from ds4c.reference == the IR's router_scores + route; ids follow
    the tie rule on the tie-heavy inputs; weights sum to route_scale."""
    spec = _rt(case)
    inp = R.random_inputs(spec, torch.Generator().manual_seed(2))
    ref = R.reference(spec, **inp)
    s = P.sqrtsoftplus(inp["z"])
    if spec.hash:
        ids, w = B.route(s, None, inp["table"][inp["tokens"]], spec.k, spec.scale)
    else:
        ids, w = B.route(s, inp["table"], None, spec.k, spec.scale)
    assert torch.equal(ref["ids"], ids) and torch.equal(ref["weights"], w)
    (s_ir,) = RouterScores.run(None, [inp["z"]], {})
    ids_ir, w_ir = Route.run(None, [s_ir, inp["tokens"], inp["table"]], {"k": spec.k, "scale": spec.scale,
                                                                          "hash": spec.hash})
    assert torch.equal(ref["ids"], ids_ir) and torch.equal(ref["weights"], w_ir)
    assert ref["ids"].shape == (spec.q, spec.k) and ref["ids"].dtype == torch.int64
    assert ref["weights"].dtype == torch.float32
    assert torch.allclose(ref["weights"].sum(-1), torch.full((spec.q,), spec.scale), rtol=1e-6)
    if spec.hash:
        assert torch.equal(ref["ids"], inp["table"][inp["tokens"]])
    else:  # the kernel's rank rule picks the same ids: #(j ahead of e) < k, where ahead = (v_j > v_e) or tie, j < e
        v = s + inp["table"]
        for r in range(spec.q):
            vr = v[r]
            ahead = (vr.unsqueeze(1) > vr.unsqueeze(0)) | ((vr.unsqueeze(1) == vr.unsqueeze(0))
                                                           & (torch.arange(spec.experts).unsqueeze(1)
                                                              < torch.arange(spec.experts).unsqueeze(0)))
            rank = ahead.sum(0)
            order = torch.argsort(rank)[: spec.k]
            assert torch.equal(order, ref["ids"][r])
            if r % 2 == 0 and r != spec.q - 1 and spec.experts >= 8:  # k + 2 tied leaders: a tie across the cut
                top = vr[ref["ids"][r]]
                assert bool((top == top[0]).all())
                tied = (vr == top[0]).nonzero().flatten()
                assert tied.numel() > spec.k and torch.equal(ref["ids"][r], tied[: spec.k])


def test_router_hand_ties() -> None:
    spec = R.RouterSpec(q=2, experts=8, k=3)
    z = torch.tensor([[0.5] * 8, [1.0, 2.0, 2.0, 0.0, 2.0, 2.0, -1.0, 30.0]])
    bias = torch.zeros(8)
    ref = R.reference(spec, z, torch.zeros(2, dtype=torch.int64), bias)
    assert ref["ids"].tolist() == [[0, 1, 2], [7, 1, 2]]
    assert torch.allclose(ref["weights"][0], torch.full((3,), 0.5))
    # softplus threshold 20: z > 20 passes through, so s = sqrt(30)
    assert float(P.sqrtsoftplus(torch.tensor([30.0]))) == float(torch.tensor(30.0).sqrt())


# ------------------------------------------------------------------------------------- CPU emulation of the kernels
# The rendered kernels themselves, run on the CPU: the vendor prelude is swapped for one where a block's threads
# are fibers on one OS thread (emulators/experts_emu.py's FIBERS), ds4c_sync is a barrier that parks a fiber until the
# whole block arrives and a shuffle is an exchange through memory between two barriers (valid because every sync
# and shuffle in these kernels is reached by the whole block). This runs the kernel
# bodies as written, at wave 32 and wave 64, before any GPU sees them.
_EMU_PRELUDE = r"""
#include <cstring>
#include <cmath>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <ucontext.h>
""" + _FIBERS.replace("{", "{{").replace("}", "}}") + r"""
#define DS4C_CPU_EMU 1
#define DS4C_WAVE {wave}
#define DS4C_GLOBAL extern "C"
#define DS4C_PDL_ENTRY() do {{ }} while (0)  /* programmatic dependent launch: nothing to wait for on the host */
#define DS4C_DEVICE static inline
#define DS4C_SHARED static
#define DS4C_RESTRICT __restrict__
#define DS4C_LAUNCH_BOUNDS(n)
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef short i16;
typedef unsigned int u32; typedef int i32; typedef long long i64; typedef unsigned long long u64;
#define g_tid emu_cur
int g_bx, g_by, g_nbx;
EmuBarrier* g_bar;
u32 g_shfl[1024];
DS4C_DEVICE int ds4c_tid() {{ return g_tid; }}
DS4C_DEVICE int ds4c_bid_x() {{ return g_bx; }}
DS4C_DEVICE int ds4c_bid_y() {{ return g_by; }}
DS4C_DEVICE int ds4c_nblk_x() {{ return g_nbx; }}
DS4C_DEVICE int ds4c_lane() {{ return g_tid & (DS4C_WAVE - 1); }}
DS4C_DEVICE void ds4c_sync() {{ g_bar->arrive_and_wait(); }}
DS4C_DEVICE float ds4c_as_float(u32 b) {{ float f; std::memcpy(&f, &b, 4); return f; }}
DS4C_DEVICE u32 ds4c_as_u32(float f) {{ u32 b; std::memcpy(&b, &f, 4); return b; }}
DS4C_DEVICE int ds4c_shfl_xor_i(int v, int mask) {{
  g_shfl[g_tid] = (u32)v; g_bar->arrive_and_wait();
  int r = (int)g_shfl[g_tid ^ mask]; g_bar->arrive_and_wait(); return r; }}
DS4C_DEVICE float ds4c_shfl_xor(float v, int mask) {{
  return ds4c_as_float((u32)ds4c_shfl_xor_i((int)ds4c_as_u32(v), mask)); }}
DS4C_DEVICE float ds4c_exp(float x) {{ return expf(x); }}
DS4C_DEVICE float ds4c_rint(float x) {{ return rintf(x); }}
DS4C_DEVICE float ds4c_log1p(float x) {{ return log1pf(x); }}
DS4C_DEVICE float ds4c_sqrt(float x) {{ return sqrtf(x); }}
DS4C_DEVICE float ds4c_rsqrt(float x) {{ return 1.0f / sqrtf(x); }}
DS4C_DEVICE float ds4c_cos(float x) {{ return cosf(x); }}
DS4C_DEVICE float ds4c_sin(float x) {{ return sinf(x); }}
DS4C_DEVICE float ds4c_atomic_add(float* p, float v) {{  /* one fiber runs at a time: a plain update is atomic */
  float o = *p; *p = o + v; return o; }}
"""

_EMU_DRIVER = r"""
typedef void (*ds4c_emu_fn)({params});
int main(int argc, char** argv) {{
  int gx = atoi(argv[1]), gy = atoi(argv[2]), nt = atoi(argv[3]), nargs = argc - 4;
  std::vector<void*> bufs(nargs); std::vector<size_t> sizes(nargs);
  for (int i = 0; i < nargs; ++i) {{
    FILE* f = fopen(argv[4 + i], "rb"); fseek(f, 0, SEEK_END); sizes[i] = ftell(f); fseek(f, 0, SEEK_SET);
    bufs[i] = aligned_alloc(64, (sizes[i] + 127) / 64 * 64); if (fread(bufs[i], 1, sizes[i], f) != sizes[i]) return 2;
    fclose(f);
  }}
  ds4c_emu_fn fn = (ds4c_emu_fn)&{entry};
  g_nbx = gx;
  for (int by = 0; by < gy; ++by) for (int bx = 0; bx < gx; ++bx) {{
    g_bx = bx; g_by = by;
    EmuBarrier bar(nt); g_bar = &bar;
    auto body = [&](int) {{ fn({call}); }};
    emu_run_fibers(nt, body);
  }}
  for (int i = 0; i < nargs; ++i) {{ FILE* f = fopen(argv[4 + i], "wb"); fwrite(bufs[i], 1, sizes[i], f); fclose(f); }}
  return 0;
}}
"""


def _emu_build(src, workdir: Path) -> Path:
    """A CPU executable of one rendered kernel (all of whose arguments are pointers)."""
    import jinja2

    vendor_prelude = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True).from_string(
        src.templates[f"prelude/{src.target.vendor}.h.j2"]).render(wave=src.target.wave)
    assert vendor_prelude in src.source
    text = src.source.replace(vendor_prelude, _EMU_PRELUDE.format(wave=src.target.wave))
    n = len(_sig_names(src.source, src.entry))
    text += _EMU_DRIVER.format(params=", ".join(["void*"] * n), call=", ".join(f"bufs[{i}]" for i in range(n)),
                               entry=src.entry)
    d = workdir / f"emu_{src.entry}_{src.target.arch}"
    d.mkdir()
    (d / "k.cpp").write_text(text)
    p = subprocess.run(["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-w", "-o", "k", "k.cpp"],
                       cwd=d, capture_output=True, text=True)
    if p.returncode and re.search(r"'?ds4c_\w+'? was not declared", p.stderr):
        pytest.skip("the vendor prelude grew a helper the CPU emulation prelude lacks: "
                    + re.search(r"ds4c_\w+", p.stderr.split("not declared")[0][-200:]).group(0))
    assert p.returncode == 0, p.stderr[-3000:]
    return d / "k"


def _emu_launch(exe: Path, grid: tuple, block: tuple, args: list[torch.Tensor], workdir: Path) -> None:
    """Run the emulated kernel; the tensors (contiguous, CPU) are updated in place."""
    import numpy as np

    files = []
    for i, a in enumerate(args):
        f = workdir / f"{exe.parent.name}_a{i}.bin"
        a.contiguous().view(torch.uint8).numpy().tofile(f)
        files.append(f)
    p = subprocess.run([str(exe), str(grid[0]), str(grid[1]), str(block[0]), *map(str, files)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    for a, f in zip(args, files):
        raw = torch.from_numpy(np.fromfile(f, dtype=np.uint8))
        a.view(torch.uint8).view(-1).copy_(raw)


def _have_emu() -> str | None:
    if not shutil.which("g++"):
        return "g++ not on PATH"
    return None


EMU_IX = [  # (spec kwargs, input kwargs)
    (dict(IX_OFFICIAL, cap=1024, q=5), {}),  # every row past topk: radix threshold, ties across the cut
    (dict(IX_OFFICIAL, cap=1024, q=5), {"pos": 4 * 300 - 2}),  # fewer than topk visible: -1 padding
    (dict(IX_OFFICIAL, cap=1024, q=5), {"pos": 0}),  # nvalid 0, 0, 0, 1, 1
    (dict(IX_TINY, cap=1000, q=5), {"pos": 400, "live": 5}),  # live below the causal limit, cap % 8 != 0 tiles
    (dict(IX_TINY, cap=1000, q=2), {"fp4": False}),  # plain bf16 inputs: bit-exact with the kernel model
]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_emulated_indexer(arch: str, tmp_path: Path) -> None:
    """The rendered indexer kernels run on the CPU (wave 32 and 64): scores bit-identical to kernel_scores, ids
    identical to reference() (and to kernel_select), every output written."""
    why = _have_emu()
    if why:
        pytest.skip(why)
    t = target(arch)
    g = torch.Generator().manual_seed(77)
    keys = {I.IndexerSpec(**dict(sk, q=1)).kernel_key(): I.IndexerSpec(**dict(sk, q=1)) for sk, _ in EMU_IX}
    srcs = [k for s in keys.values() for k in I.render_indexer(s, t)]
    with ThreadPoolExecutor(4) as ex:
        exes = dict(zip([k.entry for k in srcs], ex.map(lambda k: _emu_build(k, tmp_path), srcs)))
    for sk, ik in EMU_IX:
        spec = I.IndexerSpec(**sk)
        inp = I.random_inputs(spec, g, **ik)
        ref = I.reference(spec, **inp)
        name = f"indexer_{spec.kernel_key()}"
        scores = torch.full((spec.q, spec.cap), 0x7FC1, dtype=torch.int16).view(BF16)
        out = torch.full((spec.q, spec.kout), -7777, dtype=torch.int64)
        ls, lsel = I.launch_shapes(spec)
        _emu_launch(exes[name + "_scores"], ls.grid, ls.block,
                    [inp["qi"], inp["keys"], inp["hw"], inp["positions"], inp["live"], scores], tmp_path)
        _emu_launch(exes[name + "_select"], lsel.grid, lsel.block, [scores, inp["positions"], inp["live"], out],
                    tmp_path)
        model = I.kernel_scores(spec, **inp)
        assert torch.equal(scores.view(torch.int16), model.view(torch.int16)), (sk, ik)
        assert torch.equal(out, I.kernel_select(spec, scores, inp["positions"], inp["live"])), (sk, ik)
        assert torch.equal(out, ref["out"]), (sk, ik)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_emulated_router(arch: str, tmp_path: Path) -> None:
    """The rendered router kernels run on the CPU: ids identical to reference() on tie-heavy rows, weights within
    1e-6 relative (exp / log1p of the C library instead of torch's)."""
    why = _have_emu()
    if why:
        pytest.skip(why)
    t = target(arch)
    g = torch.Generator().manual_seed(78)
    specs = [R.RouterSpec(q=5), R.RouterSpec(q=5, hash=True), R.RouterSpec(q=5, experts=16, k=4),
             R.RouterSpec(q=3, from_logits=False)]
    srcs = [R.render_router(s, t)[0] for s in specs]
    with ThreadPoolExecutor(4) as ex:
        exes = list(ex.map(lambda k: _emu_build(k, tmp_path), srcs))
    for spec, exe in zip(specs, exes):
        inp = R.random_inputs(spec, g)
        if not spec.from_logits:
            inp["z"] = P.sqrtsoftplus(inp["z"])
        ref = R.reference(spec, **inp)
        ids = torch.full((spec.q, spec.k), -7777, dtype=torch.int64)
        w = torch.full((spec.q, spec.k), float("nan"))
        (ln,) = R.launch_shapes(spec)
        _emu_launch(exe, ln.grid, ln.block, [inp["z"], inp["tokens"], inp["table"], ids, w], tmp_path)
        assert torch.equal(ids, ref["ids"]), spec
        assert float(((w - ref["weights"]).abs() / ref["weights"].abs()).max()) < 1e-6, spec
