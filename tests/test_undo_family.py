"""The undo family (runtime/families/undo.py, templates/undo/rollback.cu.j2) and the undo saves of the
compressor and grouped wo_a kernels: rendering and device compiles; and, on the CPU through the kernel-body
emulation of tests/test_compressor_family.py, the compressor kernel with undo followed by the rollback kernel
for every accepted count, bit for bit against the compressor reference run on the accepted rows alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ds4c.config import preset
from ds4c.runtime.families import compressor as C
from ds4c.runtime.families import rowchain as RC
from ds4c.runtime.families import undo as U
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from gpu_checks import compressor as G
from kernel_compile import compile_kernel, toolchain_or_skip
from test_compressor_family import _emulated, emulate_kernel

BF16, F32 = torch.bfloat16, torch.float32


def _tiny_comps(q: int, undo: bool = True) -> list[C.CompressorSpec]:
    return [C.CompressorSpec(4, 192, False, True, 128, 64, q, undo=undo),
            C.CompressorSpec(4, 128, True, True, 0, 64, q, undo=undo)]


# --------------------------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
@pytest.mark.parametrize("name", ["tiny", "flash-l4"])
def test_rollback_kernel_renders_and_compiles(name, arch, tmp_path):
    cfg = preset(name)
    comps = []
    for i in range(cfg.n_layers):
        r = cfg.ratio(i)
        if r == 4:
            comps += [(4, 2 * cfg.head_dim), (4, 2 * cfg.index_head_dim)]
        elif r:
            comps.append((r, cfg.head_dim))
    spec = U.RollbackSpec(5, cfg.window, cfg.head_dim, cfg.n_layers, tuple(comps))
    src = U.render_rollback(spec, target(arch), f"rollback_{name}")
    sig = re.search(r"DS4C_GLOBAL void \w+\((.*?)\)\s*\{", re.sub(r"//[^\n]*", "", src.source), re.S).group(1)
    assert [re.findall(r"\w+", p)[-1] for p in sig.split(",")] == U.arg_names(spec)
    assert U.launch_shape(spec).grid == (cfg.n_layers + len(comps), 1, 1)
    toolchain_or_skip(arch)
    c = compile_kernel(src, tmp_path)
    assert not c.usage.get("spills"), c.usage


def test_specs_refuse_what_needs_no_undo():
    with pytest.raises(RenderError, match="comps"):
        U.RollbackSpec(5, 16, 192, 6, ((6, 192),))
    with pytest.raises(RenderError, match="q 1"):
        U.RollbackSpec(1, 16, 192, 6)
    with pytest.raises(RenderError, match="ring_undo without a ring write"):
        RC.GroupedSpec(5, 4, 192, 2, 64, ring_undo=True)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_undo_saves_compile(arch, tmp_path):
    toolchain_or_skip(arch)
    official = [C.CompressorSpec(4, 512, False, True, 448, 64, 5, undo=True),
                C.CompressorSpec(4, 128, True, True, 0, 64, 5, undo=True)]
    srcs = [C.render_compressor(_tiny_comps(5), target(arch), "cmp_undo"),
            C.render_compressor(official, target(arch), "cmp_undo_official"),
            C.render_compressor([C.CompressorSpec(128, 512, False, True, 448, 64, 5, undo=True)], target(arch),
                                "cmp_undo_hca"),
            RC.render_grouped(RC.GroupedSpec(5, 64, 512, 8, 1024, rope_dim=64, ring_window=128, kv_width=512,
                                             ring_undo=True, pos_dtype="i64"), target(arch), "wo_a_undo_official"),
            RC.render_grouped(RC.GroupedSpec(5, 4, 192, 2, 64, rope_dim=64, ring_window=16, kv_width=192,
                                             ring_undo=True, pos_dtype="i64"), target(arch), "wo_a_undo")]
    for s in srcs:
        wd = tmp_path / s.entry
        wd.mkdir()
        assert not compile_kernel(s, wd).usage.get("spills")
    assert "ring_undo" in [a.name for a in RC.GroupedSpec(5, 4, 192, 2, 64, ring_window=16, kv_width=192,
                                                          ring_undo=True).args()]


def test_grouped_reference_saves_the_overwritten_rows():
    spec = RC.GroupedSpec(3, 4, 192, 2, 64, ring_window=16, kv_width=192, ring_undo=True, pos_dtype="i64")
    inp = RC.make_grouped_inputs(spec, pos=14)
    out = RC.grouped_reference(spec, inp)
    for i, p in enumerate(range(14, 17)):
        assert torch.equal(out["ring_undo"][i], inp["ring"][p % 16])
        assert torch.equal(out["ring"][p % 16], inp["kv"][i])


# ------------------------------------------------------------------------------------ CPU kernel emulation
def _emulate_rollback(spec: U.RollbackSpec, workdir: Path):
    src = U.render_rollback(spec, target("sm_90"), "emu_rollback")
    cast = {"pos": "const i64*", "accepted": "const i64*", "ring": "u16*", "ring_undo": "const u16*",
            "kv": "float*", "score": "float*", "undo": "const float*"}
    shape = U.launch_shape(spec)
    return emulate_kernel(src, U.arg_names(spec), cast, shape.grid[0], shape.block[0], workdir)


@pytest.mark.slow
@pytest.mark.parametrize("kind,q", [("csa", 5), ("csa", 3), ("hca", 5)])
def test_compressor_undo_then_rollback_rebuilds_the_accepted_state(kind, q, tmp_path):
    """For every step position mod 4 (with q = 5 at pos % 4 == 3: two flushes, the first block surviving only in
    the undo buffer; for ratio 16 steps across a flush, whose rejected rows of the next block overwrite slots the
    rejected flush still needs) and every accepted count: the compressor kernel (emulated) saves exactly what
    the undo layout says, and the rollback kernel (emulated) leaves the state the compressor reference leaves
    after the accepted rows alone, bit for bit; the ring's rejected rows get their old values back."""
    specs = _tiny_comps(q) if kind == "csa" else [C.CompressorSpec(16, 192, False, True, 128, 64, q, undo=True)]
    comp = _emulated(specs, f"emu_cmp_undo_{kind}_q{q}", tmp_path)
    rspec = U.RollbackSpec(q, 16, 192, 1, tuple((s.ratio, s.state_width) for s in specs))
    roll = _emulate_rollback(rspec, tmp_path)
    gen = torch.Generator().manual_seed(5 + q)
    for pos in ((8, 9, 10, 11, 1003) if kind == "csa" else (12, 13, 14, 15, 1613)):
        inps = [G.make_inputs(s, pos, gen) for s in specs]
        s0 = [(inp["kv"].clone(), inp["score"].clone()) for inp in inps]
        work = [{k: v.clone().contiguous() for k, v in inp.items()} for inp in inps]
        undo = [torch.full((U.compressor_undo_floats(s.ratio, s.state_width),), float("nan"), dtype=F32)
                for s in specs]
        for w, u in zip(work, undo):
            w["undo"] = u
        args = [torch.tensor([pos], dtype=torch.int64)]
        for w in work:
            args += [w[a] for a in C.ARGS_PER_COMPRESSOR] + [w["undo"]]
        comp(args)
        for s, inp, w, u, (kv0, sc0) in zip(specs, inps, work, undo, s0):
            W = s.state_width
            if s.ratio == 4:
                assert torch.equal(u[:8 * W].view(8, W), kv0) and torch.equal(u[8 * W:16 * W].view(8, W), sc0)
                rows = u[16 * W:16 * W + 2 * q * W].view(q, 2, W)
                for i in range(q):
                    assert torch.equal(rows[i, 0], inp["v"][i])
                    assert torch.equal(rows[i, 1], inp["g"][i] + inp["ape"][(pos + i) % 4])
            else:  # the old values of the overwritten slots
                old = u[:2 * q * W].view(q, 2, W)
                for i in range(q):
                    assert torch.equal(old[i, 0], kv0[(pos + i) % s.ratio])
                    assert torch.equal(old[i, 1], sc0[(pos + i) % s.ratio])
        ring0 = torch.randn(16, 192, generator=gen).to(BF16)
        ring_undo = torch.randn(5, 192, generator=gen).to(BF16)
        for acc in range(q + 1):
            ring = ring0.clone()
            post = [(w["kv"].clone(), w["score"].clone()) for w in work]
            rargs = [torch.tensor([pos], dtype=torch.int64), torch.tensor([acc], dtype=torch.int64), ring, ring_undo]
            for (kv, sc), u in zip(post, undo):
                rargs += [kv, sc, u]
            roll(rargs)
            want_ring, _ = U.reference(rspec, pos, acc, [(ring0, ring_undo)], [])
            assert torch.equal(ring, want_ring[0]), (pos, acc)
            for s, inp, (kv, sc) in zip(specs, inps, post):
                if acc == 0:
                    wk, ws = inp["kv"], inp["score"]
                else:
                    sa = C.CompressorSpec(s.ratio, s.d, s.indexer, s.emulate, s.nope, s.rope_dim, acc, s.eps)
                    wk, ws, _ = C.reference(sa, inp["v"][:acc], inp["g"][:acc], inp["ape"], inp["norm"], inp["kv"],
                                            inp["score"], inp["rows"], pos, inp["freqs"])
                assert torch.equal(kv, wk) and torch.equal(sc, ws), (s.indexer, pos, acc)
            # the torch model of the kernel agrees too
            after = [(w["kv"], w["score"]) for w in work]
            _, model = U.reference(rspec, pos, acc, [], [(k, s_, u) for (k, s_), u in zip(after, undo)])
            for (kv, sc), (mk, ms) in zip(post, model):
                assert torch.equal(kv, mk) and torch.equal(sc, ms)
