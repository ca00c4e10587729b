"""The row-chain and grouped ``wo_a`` kernel families (ds4c.runtime.families.rowchain; spec ds4-flash.md P1-P7,
5.2(c),(d),(f),(h.1),(j),(k)), on the CPU:

* render + compile every decode-step chain (KV, q, indexer q, inverse-RoPE output, head weights, q_norm, KV with
  the ring write) and the grouped kernel (official H=64, hd=512, G=8, R=1024 and tiny H=4, hd=192, G=2, R=64;
  q = 1 and 5; with and without the fused inverse-RoPE prologue and the ring write) for sm_90 (nvcc) and
  gfx942 / gfx1151 (clang >= 19): no spills, no stack beyond the trig slow path, static shared memory within
  48 KiB; each compiler skips with a reason when missing;
* the families' ``reference`` against the IR ops' own implementations (which the interpreter runs) bit for bit
  on fresh random data;
* spec validation errors.

The kernels run on a GPU in tests/gpu_checks/rowchain.py.
"""

from __future__ import annotations

import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ds4c.config import preset
from ds4c.ir.ops import OPS
from ds4c.reference import primitives as P
from ds4c.runtime.families import rowchain as R
from ds4c.runtime.render import KernelSource, RenderError
from ds4c.runtime.targets import target
from kernel_compile import compile_kernel, compiler_missing

ARCHS = ("sm_90", "gfx942", "gfx1151")
CONFIGS = ("flash", "tiny")
MAX_STACK = 64  # bytes: the CUDA libdevice sinf/cosf slow path (Payne-Hanek) keeps a small local array


# ----------------------------------------------------------------------------------------------- kernels
def _kernels() -> dict[str, R.RowChainSpec | R.GroupedSpec]:
    out: dict[str, R.RowChainSpec | R.GroupedSpec] = {}
    for c in CONFIGS:
        cfg = preset(c)
        for n, s in R.decode_chains(cfg).items():
            out[f"{c}.{n}"] = s
        for q in (1, 5):
            out[f"{c}.wo_a.q{q}"] = R.decode_grouped(cfg, q)
            out[f"{c}.wo_a_plain.q{q}"] = R.decode_grouped(cfg, q, rope_prologue=False)
            out[f"{c}.wo_a_ring.q{q}"] = R.decode_grouped(cfg, q, ring=True)
    cfg = preset("flash")
    out["flash.kv_rows_i64"] = R.RowChainSpec(1, 512, R.decode_chains(cfg)["kv"].ops, ring_window=128,
                                               pos_mode="rows", pos_dtype="i64")
    out["flash.q_norm_pergroup"] = R.RowChainSpec(8, 128, (R.rms_norm(1e-6, per_group=True),))
    out["tiny.hw_odd"] = R.RowChainSpec(1, 4, (R.mul_scalar(0.25),))  # 4 threads, no shuffles
    out["tiny.rms_odd"] = R.RowChainSpec(1, 40, (R.rms_norm(1e-6),))  # 5 threads: shared-memory sum
    return out


KERNELS = _kernels()


def _render(name: str, arch: str) -> KernelSource:
    spec = KERNELS[name]
    entry = "k_" + re.sub(r"\W", "_", name)
    if isinstance(spec, R.RowChainSpec):
        return R.render_rowchain(spec, target(arch), entry)
    return R.render_grouped(spec, target(arch), entry)


def _compile_one(name: str, arch: str) -> dict:
    src = _render(name, arch)
    assert not re.search(r"^\s*#\s*include", src.source, re.M)
    why = compiler_missing(arch)
    if why:
        return {"skip": f"no compiler for {arch}: {why}"}
    with tempfile.TemporaryDirectory(prefix="ds4c-rowchain-") as d:
        c = compile_kernel(src, Path(d), require_usage=False)
        return {"seconds": c.seconds, "usage": c.usage or None, "source": src}


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, str], dict]:
    """Every (kernel, arch) compiled once, in parallel (exceptions kept per entry)."""
    jobs = [(n, a) for n in KERNELS for a in ARCHS]

    def run(job):
        try:
            return job, _compile_one(*job)
        except Exception as e:  # reported by the test of that entry
            return job, {"error": e}

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        return dict(ex.map(run, jobs))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(KERNELS))
def test_compiles_without_spills(compiled, name, arch):
    r = compiled[(name, arch)]
    if "skip" in r:
        pytest.skip(r["skip"])
    if "error" in r:
        raise r["error"]
    u = r["usage"]
    assert u is not None, f"no resource usage for {name} on {arch}"
    assert not u["spills"], f"{name} on {arch} spills: {u}"
    assert u.get("stack_bytes", 0) <= MAX_STACK, f"{name} on {arch}: stack {u}"
    assert u.get("smem_bytes", 0) <= R.STATIC_SMEM_LIMIT
    if target(arch).vendor == "cuda":
        assert u.get("registers", 0) <= 128, f"{name}: {u}"  # 2 blocks of 256 threads per SM


def test_compile_summary(compiled, capsys):
    """Prints registers / shared memory / compile seconds per kernel (run with -s to see it)."""
    rows = []
    for (n, a), r in sorted(compiled.items()):
        if "usage" in r and r["usage"]:
            u = r["usage"]
            rows.append(f"{n:24s} {a:8s} regs {u.get('registers', '?'):>4} smem {u.get('smem_bytes', 0):>6} "
                        f"stack {u.get('stack_bytes', 0):>3} {r['seconds']:5.2f} s")
    with capsys.disabled():
        print("\n" + "\n".join(rows))


def test_launch_shapes():
    cfg = preset("flash")
    ch = R.decode_chains(cfg)
    assert R.rowchain_launch(ch["kv"], 5) == R.Launch((1, 5, 1), (64, 1, 1))
    assert R.rowchain_launch(ch["q"], 3).grid == (64, 3, 1)
    assert R.rowchain_launch(ch["idx_q"], 1).block == (32, 1, 1)  # 32 lanes x 4 for the 128-point Hadamard
    assert R.rowchain_launch(ch["q_norm"], 1).block == (128, 1, 1)
    g = R.decode_grouped(cfg, 5)
    assert R.grouped_launch(g, target("sm_90")).grid == (8 * 1024 // 32, 1, 1)
    assert R.grouped_launch(g, target("gfx942")).grid == (8 * 1024 // 16, 1, 1)
    assert [a.name for a in g.args()] == ["o", "w", "z", "pos", "freqs"]
    assert [a.name for a in R.decode_grouped(cfg, 1, ring=True).args()] == ["o", "w", "z", "pos", "freqs", "kv", "ring"]
    assert [a.name for a in ch["kv_ring"].args()] == ["x", "out", "w0", "pos", "freqs1", "ring"]
    assert [a.name for a in ch["hw"].args()] == ["x", "out"]


def test_rendered_source_matches_args():
    """Every argument name appears in the kernel signature in order; fp32 constants are exact hex floats."""
    cfg = preset("flash")
    s = R.decode_chains(cfg)["hw"]
    src = R.render_rowchain(s, target("sm_90"), "hw").source
    lit = R.f32_literal(cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
    assert lit in src
    assert float.fromhex(lit[1:-2]) == float(torch.tensor(128 ** -0.5 * 64 ** -0.5, dtype=torch.float32))
    kv = R.decode_chains(cfg)["kv_ring"]
    sig = R.render_rowchain(kv, target("gfx942"), "k_sig").source.split("k_sig(", 1)[1].split(")", 1)[0]
    pos = [sig.index(a.decl) for a in kv.args()]
    assert pos == sorted(pos)


@pytest.mark.parametrize("c,nv", [(40, 37), (40, 5), (40, 16), (16, 16)])
def test_ring_valid_equals_the_ir_ring_write(c, nv):
    """RowChainSpec.ring_valid (a prefill chunk): only rows n_valid-window .. n_valid-1 write their slot, so a
    chunk longer than the window has one writer per slot and padded rows none; that leaves the ring exactly as
    the IR's ring_write with n_valid (rows written in order) does. The kernel's source has the same rule, an
    n_valid argument after the ring, and the decode kernel (ring_valid off) none of it."""
    w, d = 16, 64
    spec = R.RowChainSpec(1, d, (), ring_window=w, pos_dtype="i64", ring_valid=True)
    g = torch.Generator().manual_seed(c + nv)
    x = torch.randn(c, 1, d, generator=g).to(torch.bfloat16)
    ring0 = torch.randn(w, d, generator=g).to(torch.bfloat16)
    pos = 1003
    got = R.rowchain_reference(spec, {"x": x, "pos": torch.tensor([pos]), "ring": ring0,
                                      "n_valid": torch.tensor([nv])})["ring"]
    want = _ir("ring_write", [ring0, x.reshape(c, d), torch.arange(pos, pos + c), torch.tensor(nv)], window=w)
    assert torch.equal(got, want)
    src = R.render_rowchain(spec, target("sm_90"), "rw").source
    assert f"if (row < nv && row + {w} >= nv)" in src and [a.name for a in spec.args()][-2:] == ["ring", "n_valid"]
    dec = R.render_rowchain(R.RowChainSpec(1, d, (), ring_window=w, pos_dtype="i64"), target("sm_90"), "rw").source
    assert "n_valid" not in dec
    with pytest.raises(RenderError, match="ring_valid"):
        R.RowChainSpec(1, d, (R.mul_scalar(2.0),), ring_valid=True)


# ------------------------------------------------------------------------------------------ references
def _ir(kind: str, ins: list, **attrs):
    return OPS[kind].run(None, ins, attrs)[0]


def _chain_via_ir(spec: R.RowChainSpec, inp: dict) -> torch.Tensor:
    """The chain by the IR ops (the interpreter's implementations), in the IR's own shapes: whole-row chains
    on [q, W] (G = 1), per-head chains on [q, G, W]."""
    x = inp["x"]
    q, G, W = x.shape
    y = x.reshape(q, W) if G == 1 else x
    positions = inp["pos"].to(torch.int64).reshape(-1)[0] + torch.arange(q) if spec.needs_pos else None
    for i, op in enumerate(spec.ops):
        if op.kind == "rms_norm":
            y = _ir("rms_norm", [y, inp[f"w{i}"]], eps=op.eps)
        elif op.kind == "head_rms":
            y = _ir("head_rms", [y], eps=op.eps)
        elif op.kind == "rope":
            y = _ir("rope", [y, positions, inp[f"freqs{i}"]], inverse=op.inverse)
        elif op.kind == "kv_fq":
            y = _ir("kv_fake_quant", [y], nope=op.nope, enabled=True)
        elif op.kind == "hadamard":
            y = _ir("hadamard", [y])
        elif op.kind == "fp4_fq":
            y = _ir("fp4_fake_quant", [y], block=op.block)
        elif op.kind == "mul_scalar":
            y = _ir("mul_scalar", [y], value=op.value)
    return y.reshape(q, G, W)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("cfg_name", CONFIGS)
def test_rowchain_reference_matches_ir_bit_for_bit(cfg_name, q):
    cfg = preset(cfg_name)
    gen = torch.Generator().manual_seed(7 + q)
    for n, spec in R.decode_chains(cfg).items():
        pos = int(torch.randint(1, 70000, (1,), generator=gen))
        inp = R.make_rowchain_inputs(spec, q, pos=pos, generator=gen)
        ref = R.rowchain_reference(spec, inp)
        want = _chain_via_ir(spec, inp)
        assert torch.equal(_bits(ref["out"]), _bits(want)), f"{cfg_name}.{n}"
        if spec.ring_window:
            ring = _ir("ring_write", [inp["ring"], want.reshape(q, -1), pos + torch.arange(q)],
                       window=spec.ring_window)
            assert torch.equal(_bits(ref["ring"]), _bits(ring)), f"{cfg_name}.{n} ring"
            assert not torch.equal(_bits(ref["ring"]), _bits(inp["ring"]))


def test_rowchain_reference_per_group_weight_and_rows_mode():
    """rms_norm with a [G*W] weight is P1 per group with that group's slice; pos_mode rows reads pos[i]."""
    gen = torch.Generator().manual_seed(3)
    spec = R.RowChainSpec(4, 64, (R.rms_norm(1e-6, per_group=True), R.rope(64)), pos_mode="rows",
                          pos_dtype="i64")
    inp = R.make_rowchain_inputs(spec, 3, pos=41, generator=gen)
    inp["pos"] = torch.tensor([7, 100, 5000], dtype=torch.int64)
    out = R.rowchain_reference(spec, inp)["out"]
    w = inp["w0"].view(4, 64)
    for g in range(4):
        y = P.rms_norm(inp["x"][:, g], w[g], 1e-6)
        y = P.apply_rope(y, inp["pos"], inp["freqs1"])
        assert torch.equal(_bits(out[:, g]), _bits(y))


@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("cfg_name", CONFIGS)
def test_grouped_reference_matches_ir_bit_for_bit(cfg_name, q):
    cfg = preset(cfg_name)
    gen = torch.Generator().manual_seed(11 + q)
    spec = R.decode_grouped(cfg, q, ring=True)
    pos = int(torch.randint(1, 70000, (1,), generator=gen))
    inp = R.make_grouped_inputs(spec, pos=pos, generator=gen)
    ref = R.grouped_reference(spec, inp)
    positions = pos + torch.arange(q)
    o = _ir("rope", [inp["o"], positions, inp["freqs"]], inverse=True)
    z = _ir("grouped_linear", [o, inp["w"].float()], groups=cfg.o_groups)
    assert ref["z"].shape == (q, cfg.o_groups, cfg.o_lora_rank)
    assert torch.equal(_bits(ref["z"]), _bits(z))
    ring = _ir("ring_write", [inp["ring"], inp["kv"], positions], window=cfg.window)
    assert torch.equal(_bits(ref["ring"]), _bits(ring))
    plain = R.decode_grouped(cfg, q, rope_prologue=False)
    inp2 = {k: v for k, v in inp.items() if k in ("o", "w", "z")}
    z2 = _ir("grouped_linear", [inp["o"], inp["w"].float()], groups=cfg.o_groups)
    assert torch.equal(_bits(R.grouped_reference(plain, inp2)["z"]), _bits(z2))


def test_fake_quant_edges_in_reference():
    """The ops' reference edge cases the kernel reproduces: amax floors (all-zero blocks stay zero), e2m1
    ties to even, zero outputs are +0 in fp4."""
    x = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    x[0, 0, 64:96] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    x[0, 0, 96:98] = torch.tensor([-0.1, 6.0])  # scale 1: -0.1 rounds to zero, stored as +0
    spec = R.RowChainSpec(1, 128, (R.fp4_fq(32),))
    y = R.rowchain_reference(spec, {"x": x})["out"][0, 0]
    assert torch.equal(y[:64], torch.zeros(64, dtype=torch.bfloat16))
    assert y[64:72].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert _bits(y[96:97]).item() == 0


def test_bad_specs_raise():
    with pytest.raises(RenderError, match="op 'nope'"):
        R.ChainOp("nope")
    with pytest.raises(RenderError, match="rope_dim"):
        R.RowChainSpec(1, 512, (R.rope(63),))
    with pytest.raises(RenderError, match="hadamard"):
        R.RowChainSpec(1, 192, (R.hadamard(),))
    with pytest.raises(RenderError, match="kv_fq"):
        R.RowChainSpec(1, 512, (R.kv_fq(100),))
    with pytest.raises(RenderError, match="empty chain"):
        R.RowChainSpec(1, 512, ())
    with pytest.raises(RenderError, match="shared memory"):
        R.GroupedSpec(q=6, heads=64, head_dim=512, groups=8, rank=1024, rope_dim=64)
    with pytest.raises(RenderError, match="groups"):
        R.GroupedSpec(q=1, heads=64, head_dim=512, groups=7, rank=1024)
    with pytest.raises(RenderError, match="do not divide rank"):
        R.render_grouped(R.GroupedSpec(q=1, heads=4, head_dim=192, groups=2, rank=48), target("sm_90"), "x")
