"""The sparse-attention kernel family (runtime/families/attention.py, templates/attention/): rendering for
every kind, width and split setting at the official and tiny shapes; device compiles for sm_90 (no spills),
gfx942 and gfx1151 (skipped with a reason when a compiler is missing); and the CPU reference the GPU check
compares against, checked against the reference model's own P9 on hand-built lists and against the IR's
``sparse_attention`` op."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ds4c.reference import primitives as P
from ds4c.runtime.families import attention as A
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from kernel_compile import compile_kernel, toolchain_or_skip
from numerics import BF16_ULP, assert_same_roundings, rel_l2

BF16 = torch.bfloat16

OFFICIAL = dict(heads=64, head_dim=512, window=128)
TINY = dict(heads=4, head_dim=192, window=16)
KIND_ARGS = {
    "official": {"swa": {}, "csa": dict(cap=1024, topk=512), "hca": dict(cap=32, ratio=128), "dspark": {}},
    "tiny": {"swa": {}, "csa": dict(cap=64, topk=8), "hca": dict(cap=32, ratio=16), "dspark": {}},
}
# the target step's kinds; the DSpark drafter's ``dspark`` kind (its own list) is rendered and compiled with the others
# here and checked against its reference and on the CPU emulator in tests/test_dspark_compiled.py
STEP_KINDS = tuple(k for k in A.KINDS if k != "dspark")


def _spec(shape: str, kind: str, q: int, splits: int, hpb: int = 1) -> A.AttentionSpec:
    base = OFFICIAL if shape == "official" else TINY
    return A.AttentionSpec(kind=kind, q=q, splits=splits, heads_per_block=hpb, **base, **KIND_ARGS[shape][kind])


# (shape, kind, q, splits, heads_per_block): split off/on, plus the shared-KV variant (2 or 4 heads per block)
ALL_SPECS = [(shape, kind, q, splits, hpb) for shape in ("official", "tiny") for kind in A.KINDS for q in (1, 5)
             for splits, hpb in ((1, 1), (4, 1), (4, 4 if shape == "official" else 2))]


def _sid(p: tuple) -> str:
    return "{}-{}-q{}-s{}-h{}".format(*p)


# ------------------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("cfg", ALL_SPECS, ids=_sid)
@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
def test_render(cfg: tuple, arch: str) -> None:
    spec = _spec(*cfg)
    t = target(arch)
    ks = A.render_attention(spec, t, "sa_" + _sid(cfg))
    assert len(ks) == (2 if spec.splits > 1 else 1)
    main = ks[0]
    assert main.family == "attention" and not re.search(r"^\s*#include", main.source, re.M)
    assert f"void DS4C_LAUNCH_BOUNDS(SA_NT) {main.entry}(" in main.source
    # the signature follows arg_names
    sig = main.source.split(f"{main.entry}(", 1)[1].split(")", 1)[0]
    names = re.findall(r"(\w+)\s*(?:,|$)", sig.replace("\n", " "))
    assert names == A.arg_names(spec)["main"]
    if spec.splits > 1:
        assert ks[1].entry == main.entry + "_combine"
        assert "SA_SPLITS 4" in ks[1].source
    shapes = A.launch_shapes(spec)
    assert shapes[0].grid == (spec.heads // spec.heads_per_block, spec.q * spec.splits, 1)
    assert shapes[0].block[0] % t.wave == 0
    assert [s.kernel for s in shapes] == (["main", "combine"] if spec.splits > 1 else ["main"])


def test_spec_validation() -> None:
    with pytest.raises(RenderError, match="kind"):
        A.AttentionSpec("mla", 1, 64, 512, 128)
    with pytest.raises(RenderError, match="csa needs topk"):
        A.AttentionSpec("csa", 1, 64, 512, 128)
    with pytest.raises(RenderError, match="head_dim"):
        A.AttentionSpec("swa", 1, 64, 500, 128)
    with pytest.raises(RenderError, match="heads_per_block"):
        A.AttentionSpec("swa", 1, 64, 512, 128, heads_per_block=3)
    with pytest.raises(RenderError, match="threads"):
        A.AttentionSpec("swa", 1, 64, 512, 128, threads=96)
    assert A.AttentionSpec("swa", 1, 64, 512, 128).block_threads() == 256
    assert A.AttentionSpec("swa", 1, 4, 192, 16).block_threads() == 192
    s = A.AttentionSpec("csa", 5, 64, 512, 128, cap=1024, topk=512, splits=4)
    assert A.workspace_floats(s) == 5 * 64 * 4 * 514
    assert s.list_len == 640


# ------------------------------------------------------------------------------------------------ compile
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
def test_compile_all(arch: str, tmp_path: Path) -> None:
    """Every spec compiles; no register spills (ptxas -v / clang resource remarks)."""
    toolchain_or_skip(arch)
    t = target(arch)
    srcs = [k for cfg in ALL_SPECS for k in A.render_attention(_spec(*cfg), t, "sa_" + _sid(cfg).replace("-", "_"))]

    def job(k):
        d = tmp_path / k.entry
        d.mkdir()
        return k.entry, compile_kernel(k, d, require_usage=False)

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(job, srcs))
    for entry, c in results:
        log, use = c.log, {**c.usage, "seconds": c.seconds}
        if t.vendor == "cuda":
            assert not use.get("spills", False), f"{entry} on {arch} spills: {use}\n{log}"
            assert "0 bytes spill stores" in log, log
        else:  # AMDGPU: no VGPR spills and no scratch (an SGPR spill goes to a VGPR lane, not to memory)
            assert use.get("vgpr_spills", 0) == 0, f"{entry} on {arch} spills VGPRs: {use}\n{log}"
            assert use.get("scratch_bytes", 0) == 0, f"{entry} on {arch} uses scratch: {use}\n{log}"


# ---------------------------------------------------------------------------------------------- reference
def _inputs(spec: A.AttentionSpec, pos: int, live: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    H, hd, W = spec.heads, spec.head_dim, spec.window
    q = torch.randn(spec.q, H, hd, generator=g).to(BF16)
    ring = torch.randn(W, hd, generator=g).to(BF16)
    kv = torch.randn(spec.q, hd, generator=g).to(BF16)
    sink = torch.randn(H, generator=g)
    comp = sel = None
    if spec.kind != "swa":
        comp = torch.randn(spec.cap, hd, generator=g).to(BF16)
    if spec.kind == "csa":
        sel = torch.stack([torch.randperm(spec.cap, generator=g)[: spec.topk] for _ in range(spec.q)])
        sel[torch.rand(sel.shape, generator=g) < 0.2] = -1
    return q, ring, kv, comp, sel, sink


def _hand_list(spec: A.AttentionSpec, ring, kv, comp, sel, i: int, p: int, pos: int, live: int):
    """Row i's list built by hand from the spec text (5.2(e), section 6, 5.2(i))."""
    W = spec.window
    rows, ok = [], []
    if p >= W - 1:
        ts = list(range(p - W + 1, p + 1))
    else:
        ts = list(range(0, p + 1))
    for t in ts:
        rows.append(ring[t % W] if t < pos else kv[t - pos])
        ok.append(True)
    while len(rows) < W:
        rows.append(torch.full_like(ring[0], float("nan")))  # masked: any content
        ok.append(False)
    if spec.kind == "csa":
        for j in sel[i].tolist():
            rows.append(comp[j] if j >= 0 else torch.full_like(ring[0], float("nan")))
            ok.append(j >= 0)
    elif spec.kind == "hca":
        T = (p + 1) // spec.ratio
        for j in range(min(T, live, spec.cap)):
            rows.append(comp[j])
            ok.append(True)
    return torch.stack(rows), torch.tensor(ok)


CASES = [("tiny", k, q, pos) for k in STEP_KINDS for q in (1, 5) for pos in (0, 3, 15, 40, 200)]


@pytest.mark.parametrize("shape,kind,q,pos", CASES)
def test_reference_matches_hand_built_lists(shape: str, kind: str, q: int, pos: int) -> None:
    """reference() equals P9 (primitives.sparse_attention) on lists built by hand from the spec text."""
    spec = _spec(shape, kind, q, 1)
    live = spec.cap
    q_, ring, kv, comp, sel, sink = _inputs(spec, pos, live)
    got = A.reference(spec, q_, ring, kv, comp, sel, sink, pos, live)
    assert got.shape == (q, spec.heads, spec.head_dim) and got.dtype == BF16
    for i in range(q):
        rows, ok = _hand_list(spec, ring, kv, comp, sel, i, pos + i, pos, live)
        want = P.sparse_attention(q_[i], rows, ok, sink, spec.head_dim ** -0.5)
        assert torch.equal(got[i], want), (i, (got[i].float() - want.float()).abs().max())


def test_reference_matches_ir_op() -> None:
    """reference() equals the IR's sparse_attention op (with span_mask for hca) on the same inputs."""
    from ds4c.ir.ops import SparseAttention, SpanMask

    for kind in STEP_KINDS:
        spec = _spec("tiny", kind, 5, 1)
        pos, live = 300, 12
        q_, ring, kv, comp, sel, sink = _inputs(spec, pos, live, seed=1)
        positions = torch.arange(pos, pos + spec.q)
        ins = [q_, ring, kv, positions, sink]
        if kind == "csa":
            ins += [comp, sel]
        elif kind == "hca":
            ins += [comp, SpanMask.run(None, [comp, positions, torch.tensor(live)], {"ratio": spec.ratio})[0]]
        want = SparseAttention.run(None, ins, {"kind": kind, "window": spec.window, "scale": spec.head_dim ** -0.5})[0]
        got = A.reference(spec, q_, ring, kv, comp, sel, sink, pos, live)
        assert torch.equal(got, want), kind


@pytest.mark.parametrize("kind", STEP_KINDS)
@pytest.mark.parametrize("pos", [0, 5, 127, 3000])
def test_kernel_model_split_matches_reference(kind: str, pos: int) -> None:
    """The kernels' split-K division and combine (kernel_model) stay within bf16 tolerance of the reference;
    with one split it is the reference up to fp32 summation order."""
    spec1 = A.AttentionSpec(kind, 5, 4, 512, 128, **KIND_ARGS["official"][kind])
    live = spec1.cap
    q_, ring, kv, comp, sel, sink = _inputs(spec1, pos, live, seed=2)
    ref = A.reference(spec1, q_, ring, kv, comp, sel, sink, pos, live)
    for splits in (1, 3, 4, 16):
        spec = A.AttentionSpec(kind, 5, 4, 512, 128, splits=splits, **KIND_ARGS["official"][kind])
        got = A.kernel_model(spec, q_, ring, kv, comp, sel, sink, pos, live)
        assert not torch.isnan(got).any()
        if splits == 1:
            # one split is the reference's own loop up to fp32 summation order: bf16 roundings of fp32 values
            # that differ only in order over the key list, equal or one ulp apart
            assert_same_roundings(got, ref, k=spec.window + spec.cap, what="splits 1")
        else:
            # each split rounds its probabilities exp(s - m_split) to bf16 against its own running max, so they
            # are other roundings than the reference's: relative error <= u_bf16 on each probability (hence on
            # their weighted sum), plus the output's own bf16 rounding (<= u_bf16): 2 u_bf16 = one bf16 ulp
            # (measured 1.5e-3 to 2.4e-3 with AVX-512, AVX2 and the default CPU path alike)
            assert rel_l2(got, ref) <= BF16_ULP, (splits, rel_l2(got, ref))
