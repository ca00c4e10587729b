"""The compressor kernel family (runtime/families/compressor.py, templates/compressor/compress.cu.j2): rendering
at the official and tiny shapes; device compiles for sm_90 (no spills, registers within the block's budget),
gfx942 and gfx1151 (skipped with a reason when a compiler is missing); the CPU reference the GPU check compares
against, checked bit for bit against the IR's ``compress`` op and against the reference model's own
compressor path (tiny model, real weights and state); and the kernel body itself, run on the CPU through a
fiber-per-GPU-thread emulation of the vendor prelude (g++, C++20), against that reference with the GPU check's
own comparison."""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ds4c.ir.ops import OPS
from ds4c.reference.model import Reference
from ds4c.runtime.families import compressor as C
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from emulators.experts_emu import FIBERS
from gpu_checks import compressor as G
from kernel_compile import compile_kernel, toolchain_or_skip

BF16, F32 = torch.bfloat16, torch.float32

LAUNCHES = {
    "csa-official": lambda q: [C.CompressorSpec(4, 512, False, True, 448, 64, q),
                               C.CompressorSpec(4, 128, True, True, 0, 64, q)],
    "hca-official": lambda q: [C.CompressorSpec(128, 512, False, True, 448, 64, q)],
    "csa-tiny": lambda q: [C.CompressorSpec(4, 192, False, True, 128, 64, q),
                           C.CompressorSpec(4, 128, True, True, 0, 64, q)],
    "hca-tiny": lambda q: [C.CompressorSpec(16, 192, False, True, 128, 64, q)],
}
ALL = [(name, q) for name in LAUNCHES for q in (1, 5)]


def _lid(p: tuple) -> str:
    return f"{p[0]}-q{p[1]}"


# ------------------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("cfg", ALL, ids=_lid)
@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
def test_render(cfg: tuple, arch: str) -> None:
    specs = LAUNCHES[cfg[0]](cfg[1])
    t = target(arch)
    ks = C.render_compressor(specs, t, "cmp_" + _lid(cfg))
    assert ks.family == "compressor" and not re.search(r"^\s*#include", ks.source, re.M)
    assert f"DS4C_LAUNCH_BOUNDS(CMP_T) {ks.entry}(" in ks.source
    sig = ks.source.split(f"{ks.entry}(", 1)[1].split(")", 1)[0]
    names = re.findall(r"(\w+)\s*(?:,|$)", sig.replace("\n", " "))
    assert names == C.arg_names(specs)
    shape = C.launch_shape(specs)
    assert shape.grid == (len(specs), 1, 1) and shape.block[0] % t.wave == 0 and shape.smem == 0
    assert f"#define CMP_T {shape.block[0]}" in ks.source and f"#define CMP_Q {cfg[1]}" in ks.source
    assert C.smem_bytes(specs, shape.block[0], t.wave) <= C.STATIC_SMEM_LIMIT


def test_spec_validation_and_layout() -> None:
    s = C.CompressorSpec(4, 512, False, True, 448, 64, 5)
    assert (s.slots, s.width) == (8, 1024)
    h = C.CompressorSpec(128, 512, False, True, 448, 64, 1, slots=128, width=512)
    assert (h.slots, h.width) == (128, 512)
    with pytest.raises(RenderError, match="slots"):
        C.CompressorSpec(4, 512, False, True, 448, 64, 1, slots=4)
    with pytest.raises(RenderError, match="ratio"):
        C.CompressorSpec(6, 512, False, True, 448, 64, 1)
    with pytest.raises(RenderError, match="nope"):
        C.CompressorSpec(4, 512, False, True, 440, 64, 1)
    with pytest.raises(RenderError, match="indexer d"):
        C.CompressorSpec(4, 192, True, True, 0, 64, 1)
    with pytest.raises(RenderError, match="same q"):
        C.render_compressor([s, C.CompressorSpec(4, 128, True, True, 0, 64, 1)], target("sm_90"), "x")
    with pytest.raises(RenderError, match="threads"):
        C.block_threads([s], 96)
    # block sizes and slot splits
    assert C.block_threads(LAUNCHES["csa-official"](1)) == 512
    assert C.block_threads(LAUNCHES["hca-official"](1)) == 1024 and C.split_of(h, 1024) == 2
    assert C.block_threads(LAUNCHES["csa-tiny"](1)) == 256 and C.split_of(LAUNCHES["hca-tiny"](1)[0], 256) == 1
    assert C.arg_names(s)[:3] == ["pos", "v0", "g0"] and len(C.arg_names([s, s])) == 17


# ------------------------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("cfg", ALL, ids=_lid)
@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
def test_compile(cfg: tuple, arch: str, tmp_path: Path) -> None:
    toolchain_or_skip(arch)
    specs = LAUNCHES[cfg[0]](cfg[1])
    t = target(arch)
    src = C.render_compressor(specs, t, "cmp_" + _lid(cfg).replace("-", "_"))
    u = compile_kernel(src, tmp_path).usage  # asserts the log reports the entry's resource use
    assert not u["spills"], u
    nt = C.launch_shape(specs).block[0]
    if t.vendor == "cuda":
        assert u["registers"] * nt <= 65536, u  # the block fits the register file (launch bounds honoured)
        assert u["smem_bytes"] == C.smem_bytes(specs, nt, t.wave)


# ------------------------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("cfg", ALL + [("csa-official-noemu", 5)], ids=_lid)
def test_reference_matches_ir_op(cfg: tuple) -> None:
    """reference() == the IR's ``compress`` op, bit for bit, on fresh random data at every checked position."""
    name, q = cfg
    specs = G._official(q, emulate=False) if name.endswith("noemu") else LAUNCHES[name](q)
    gen = torch.Generator().manual_seed(7)
    for spec in specs:
        for pos in G.positions(spec):
            inp = G.make_inputs(spec, pos, gen)
            kv, score, rows = C.reference(spec, inp["v"], inp["g"], inp["ape"], inp["norm"], inp["kv"],
                                          inp["score"], inp["rows"], pos, inp["freqs"])
            attrs = {"ratio": spec.ratio, "d": spec.d, "indexer": spec.indexer, "emulate": spec.emulate,
                     "nope": spec.nope, "eps": spec.eps}
            positions = torch.arange(pos, pos + q, dtype=torch.int64)
            okv, osc, orows = OPS["compress"].run(None, [inp["v"], inp["g"], inp["ape"], inp["norm"], inp["kv"],
                                                         inp["score"], inp["rows"], positions, inp["freqs"]], attrs)
            assert torch.equal(kv, okv) and torch.equal(score, osc)
            assert torch.equal(rows.view(torch.int16), orows.view(torch.int16))
            flushed = [(pos + i) // spec.ratio for i in spec.flushes(pos)]
            assert not torch.isnan(rows[flushed].float()).any()  # the poisoned rows were written
            assert torch.equal(inp["rows"][flushed].isnan(), torch.ones_like(rows[flushed], dtype=torch.bool))


def test_reference_matches_model_compressor(tiny_weights) -> None:
    """reference() (q = 1 at each row's position) reproduces every compressor update the reference model makes
    over 25 tokens of the tiny model (ratio 4 main + indexer, ratio 16) in verify steps of 5 rows, from the
    state the model had before the update, bit for bit."""
    ref = Reference(tiny_weights, max_ctx=64)
    cfg = ref.cfg
    seen = {"n": 0, "flush": 0}
    orig = Reference._compress

    def spy(self, st, cw, cs, rows, proj, row, g, p, r, d, freqs, indexer):
        before = (cs.kv.clone(), cs.score.clone(), rows.clone())
        orig(self, st, cw, cs, rows, proj, row, g, p, r, d, freqs, indexer)
        spec = C.CompressorSpec(r, d, indexer, cfg.quant_emulation, cfg.nope_dim, cfg.rope_dim, 1, cfg.norm_eps)
        kv, score, out = C.reference(spec, proj[0][g:g + 1], proj[1][g:g + 1], cw.ape, cw.norm, *before, p,
                                     freqs)
        assert torch.equal(kv, cs.kv) and torch.equal(score, cs.score)
        assert torch.equal(out.view(torch.int16), rows.view(torch.int16))
        seen["n"] += 1
        seen["flush"] += bool(spec.flushes(p))

    Reference._compress = spy
    try:
        toks = torch.randint(2, cfg.vocab_size, (25,), generator=torch.Generator().manual_seed(3)).tolist()
        for s in range(0, 25, 5):
            ref.verify(toks[s:s + 5], s)
    finally:
        Reference._compress = orig
    n_csa = sum(1 for r in cfg.compress_ratios[:cfg.n_layers] if r == 4)
    n_hca = sum(1 for r in cfg.compress_ratios[:cfg.n_layers] if r > 4)
    assert seen["n"] == 25 * (2 * n_csa + n_hca)
    assert seen["flush"] == 6 * 2 * n_csa + 1 * n_hca  # blocks ending at 3, 7, .., 23; ratio 16 at 15


def test_check_positions_cover_flush_counts() -> None:
    for label, specs in G.cases():
        counts = {len(specs[0].flushes(p)) for p in G.positions(specs[0])}
        q, r = specs[0].q, specs[0].ratio
        assert 1 in counts, label
        assert (0 in counts) == (q < r), label
        if r == 4 and q == 5:
            assert 2 in counts, label


# --------------------------------------------------------------------------------------- CPU emulation
# A CPU stand-in for the vendor prelude: one fiber per GPU thread on one OS thread (emulators/experts_emu.py's
# FIBERS; blocks one after another), barriers for ds4c_sync, a per-wave exchange buffer for the shuffles, shared
# arrays as statics. The kernel body (after the vendor prelude of the rendered CUDA source) is compiled unchanged.
EMU_PRELUDE = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <ucontext.h>
""" + FIBERS + r"""
#define DS4C_EMU 1
#define DS4C_WAVE @WAVE@
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
#define emu_tid emu_cur
static int emu_bid;
static int emu_nblk;
static EmuBarrier* emu_bar;
static std::vector<EmuBarrier> emu_wbar;
static float emu_xch[1024];
DS4C_DEVICE int ds4c_tid() { return emu_tid; }
DS4C_DEVICE int ds4c_bid_x() { return emu_bid; }
DS4C_DEVICE int ds4c_bid_y() { return 0; }
DS4C_DEVICE int ds4c_nblk_x() { return emu_nblk; }
DS4C_DEVICE int ds4c_lane() { return emu_tid & (DS4C_WAVE - 1); }
DS4C_DEVICE void ds4c_sync() { emu_bar->arrive_and_wait(); }
DS4C_DEVICE float ds4c_as_float(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }
DS4C_DEVICE u32 ds4c_as_u32(float f) { u32 b; std::memcpy(&b, &f, 4); return b; }
DS4C_DEVICE float ds4c_shfl_xor(float v, int mask) {
  const int w = emu_tid / DS4C_WAVE;
  emu_xch[emu_tid] = v;
  emu_wbar[w].arrive_and_wait();
  const float r = emu_xch[w * DS4C_WAVE + ((emu_tid & (DS4C_WAVE - 1)) ^ mask)];
  emu_wbar[w].arrive_and_wait();
  return r;
}
DS4C_DEVICE int ds4c_shfl_xor_i(int v, int mask) {
  return (int)ds4c_as_u32(ds4c_shfl_xor(ds4c_as_float((u32)v), mask));
}
DS4C_DEVICE float ds4c_exp(float x) { return std::exp(x); }
DS4C_DEVICE float ds4c_rint(float x) { return std::rint(x); }
DS4C_DEVICE float ds4c_log1p(float x) { return std::log1p(x); }
DS4C_DEVICE float ds4c_sqrt(float x) { return std::sqrt(x); }
DS4C_DEVICE float ds4c_rsqrt(float x) { return 1.0f / std::sqrt(x); }
DS4C_DEVICE float ds4c_cos(float x) { return std::cos(x); }
DS4C_DEVICE float ds4c_sin(float x) { return std::sin(x); }
DS4C_DEVICE float ds4c_atomic_add(float* p, float v) {  // one fiber runs at a time: a plain update is atomic
  const float o = *p;
  *p = o + v;
  return o;
}
"""
_COMMON_MARK = "// ---- ds4c common device helpers"
_CAST = {"pos": "const i64*", "v": "const float*", "g": "const float*", "ape": "const float*",
         "norm": "const float*", "kv": "float*", "score": "float*", "rows": "u16*", "freqs": "const float*",
         "undo": "float*"}


def emulate_kernel(src, arg_names: list[str], casts: dict[str, str], grid: int, block: int, workdir: Path):
    """Build a rendered kernel (``src``, a KernelSource of a CUDA target) for the CPU emulation: its body after
    the vendor prelude, compiled with g++ against :data:`EMU_PRELUDE`; the entry's arguments cast by name
    (``casts[name without digits]``). Returns launch(args: list of CPU tensors), running ``grid`` blocks of
    ``block`` threads one block after another."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found (the CPU emulation of the kernel needs g++ with C++20 and <ucontext.h>)")
    if _COMMON_MARK not in src.source:
        pytest.skip("the rendered source has no common-helpers marker to cut the vendor prelude at")
    body = _COMMON_MARK + src.source.split(_COMMON_MARK, 1)[1]
    cast = ", ".join(f"({casts[n.rstrip('0123456789')]})a[{i}]" for i, n in enumerate(arg_names))
    launcher = f"""
extern "C" void emu_launch(int nblk, int nthr, void** a) {{
  emu_nblk = nblk;
  for (int b = 0; b < nblk; ++b) {{
    EmuBarrier bar(nthr);
    emu_bar = &bar;
    emu_wbar.assign(nthr / DS4C_WAVE, EmuBarrier(DS4C_WAVE));
    emu_bid = b;
    auto body = [&](int) {{ {src.entry}({cast}); }};
    emu_run_fibers(nthr, body);
  }}
}}
"""
    text = EMU_PRELUDE.replace("@WAVE@", str(src.target.wave)) + body + launcher
    cpp = workdir / f"{src.name}.cpp"
    so = workdir / f"{src.name}_{hashlib.sha1(text.encode()).hexdigest()[:10]}.so"
    cpp.write_text(text)
    proc = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-w",
                           "-o", str(so), str(cpp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        missing = sorted(set(re.findall(r"'(ds4c_\w+)' was not declared", proc.stdout.replace("‘", "'")
                                        .replace("’", "'"))))
        if missing or "ucontext" in proc.stdout:
            pytest.skip(f"CPU emulation prelude lacks {missing or '<ucontext.h>'} (vendor prelude grew?)")
        raise AssertionError(proc.stdout[-4000:])
    lib = ctypes.CDLL(str(so))

    def launch(args: list[torch.Tensor]) -> None:
        arr = (ctypes.c_void_p * len(args))(*[t.data_ptr() for t in args])
        lib.emu_launch(grid, block, arr)

    return launch


def _emulated(specs: list[C.CompressorSpec], name: str, workdir: Path, arch: str = "sm_90"):
    """The compressor kernel of ``specs`` rendered for ``arch`` (its wave size: 32 or 64), built for the CPU
    emulation (:func:`emulate_kernel`); returns launch(args: list of CPU tensors)."""
    src = C.render_compressor(specs, target(arch), name)
    shape = C.launch_shape(specs)
    return emulate_kernel(src, C.arg_names(specs), _CAST, shape.grid[0], shape.block[0], workdir)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(G.cases())), ids=[c[0].replace(" ", "-") for c in G.cases()])
@pytest.mark.parametrize("arch", ["sm_90", "gfx942"], ids=["wave32", "wave64"])
def test_kernel_body_emulated_on_cpu(case: int, arch: str, tmp_path: Path) -> None:
    """The kernel body (all GPU-check launches and positions; waves of 32 and 64) run on the CPU emulation,
    compared with the GPU check's own ``compare``: state bit-exact, untouched rows intact, written rows within
    its tolerances."""
    label, specs = G.cases()[case]
    launch = _emulated(specs, "emu_" + re.sub(r"\W", "_", label), tmp_path, arch)
    gen = torch.Generator().manual_seed(11)
    for pos in G.positions(specs[0]):
        inps = [G.make_inputs(s, pos, gen) for s in specs]
        work = [{k: v.clone().contiguous() for k, v in inp.items()} for inp in inps]
        launch(G.launch_args(specs, work, torch.tensor([pos], dtype=torch.int64)))
        for s, inp, w in zip(specs, inps, work):
            res = G.compare(s, inp, pos, w)
            assert res["ok"], (label, pos, s, res)
            assert res["state_exact"] and res["untouched_ok"]
            assert res["checked"] == len(s.flushes(pos)) * s.d
