"""The fused HC kernel family (runtime/families/hc.py, templates/hc/hc_fused.cu.j2), on the CPU:

* every variant renders for q = 1 and 5 at the official (4096) and tiny (256) widths, and compiles for sm_90
  (nvcc) and gfx942 / gfx1151 (clang) without spills; skipped with the reason when a compiler is missing;
* the kernels' signatures match the documented argument orders;
* ``reference()`` equals the reference model's own functions (primitives.hc_post / hc_pre / hc_head +
  rms_norm, as ds4c.reference.model calls them) and the IR ops of the fused pattern, bit for bit;
* the torch model of the kernels' split sums (``kernel_model``) matches the reference within fp32 tolerance.

The GPU comparison is tests/gpu_checks/hc.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ds4c.reference import primitives as P
from ds4c.runtime.families import hc as H
from ds4c.runtime.render import KernelSource, RenderError
from ds4c.runtime.targets import target
from kernel_compile import compile_kernel
from numerics import BF16_ULP, fp32_order_bound

WIDTHS = {"official": 4096, "tiny": 256}
ARCHS = ("sm_90", "gfx942", "gfx1151")


def spec_of(variant: str, width: str, q: int) -> H.HcSpec:
    return H.HcSpec(variant, q, WIDTHS[width], n_mix=4 if variant == "post_head" else 24)


# --------------------------------------------------------------------------------------------- compiling
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("q", (1, 5))
@pytest.mark.parametrize("width", tuple(WIDTHS))
@pytest.mark.parametrize("variant", H.VARIANTS)
def test_render_and_compile(variant: str, width: str, q: int, arch: str, tmp_path: Path) -> None:
    spec = spec_of(variant, width, q)
    t = target(arch)
    kernels = H.render_hc(spec, t, f"hc_{variant}_{width}_q{q}")
    stages = ("mix",) if variant == "post_out" else ("mix", "norm")
    assert [k.entry for k in kernels] == [f"hc_{variant}_{width}_q{q}_{st}" for st in stages]
    for ks in kernels:
        assert not re.search(r"^\s*#\s*include", ks.source, re.M)
        assert set(ks.templates) == {H.TEMPLATE, f"prelude/{t.vendor}.h.j2", "prelude/common.h.j2"}
        wd = tmp_path / ks.entry
        wd.mkdir()
        c = compile_kernel(ks, wd)
        use = c.usage
        assert not use["spills"], f"{ks.entry} spills on {arch}: {use}"
        assert use.get("stack_bytes", 0) == 0, f"{ks.entry} uses a stack on {arch}: {use}"
        print(f"{arch} {ks.entry}: {use.get('registers')} regs, {c.seconds:.2f} s")


# ------------------------------------------------------------------------------------ documented interface
def _signature(ks: KernelSource) -> list[str]:
    """Parameter names of the entry function, in order."""
    m = re.search(r"DS4C_GLOBAL void " + re.escape(ks.entry) + r"\((.*?)\)\s*\{", ks.source, re.S)
    assert m, ks.entry
    text = re.sub(r"//[^\n]*", "", m.group(1))
    return [re.findall(r"[A-Za-z_]\w*", p)[-1] for p in text.split(",")]


@pytest.mark.parametrize("variant", H.VARIANTS)
def test_signature_matches_arg_names(variant: str) -> None:
    spec = spec_of(variant, "tiny", 2)
    for arch in ("sm_90", "gfx942"):
        kernels = H.render_hc(spec, target(arch), "k")
        names = H.arg_names(spec)
        assert [_signature(k) for k in kernels] == [names[st] for st in ("mix", "norm") if st in names]
        assert [la.kernel for la in H.launch_shapes(spec)] == list(names)
    shapes = H.arg_shapes(spec, n_vocab=512)
    assert all(n in shapes or n == "n_vocab" for ns in names.values() for n in ns)


def test_launch_shapes_and_workspace() -> None:
    s = spec_of("post_pre", "official", 5)
    mix, norm = H.launch_shapes(s)
    assert (mix.kernel, mix.grid, mix.block) == ("mix", (128, 1, 1), (64, 1, 1))
    assert (norm.kernel, norm.grid, norm.block) == ("norm", (5, 2, 1), (256, 1, 1))
    assert H.workspace_floats(s) == 128 * 5 * 25
    t = spec_of("post_head", "tiny", 1)
    mix, norm = H.launch_shapes(t)
    assert mix.grid == (8, 1, 1) and norm.grid == (1, 1, 1) and norm.block == (64, 1, 1)
    assert H.workspace_floats(t) == 8 * 1 * 5
    # fn dominates the traffic: 1.5 MiB at the official width
    assert H.bytes_read(s) > 24 * 16384 * 4


def test_bad_specs() -> None:
    with pytest.raises(RenderError, match="variant"):
        H.HcSpec("post_post", 1, 256)
    with pytest.raises(RenderError, match="n_mix"):
        H.HcSpec("post_head", 1, 256, n_mix=24)
    with pytest.raises(RenderError, match="hidden"):
        H.HcSpec("post_pre", 1, 100)
    with pytest.raises(RenderError, match="iters"):
        H.HcSpec("post_pre", 1, 256, iters=0)


def test_float_literals_are_exact() -> None:
    src = H.render_hc(spec_of("post_pre", "tiny", 1), target("sm_90"), "k")[1].source
    lit = re.search(r"#define HC_EPS \(\(float\)(\S+)f\)", src).group(1)
    assert torch.tensor(float.fromhex(lit), dtype=torch.float32) == torch.tensor(1e-6, dtype=torch.float32)


# -------------------------------------------------------------------------------------------- references
def _model_functions(spec: H.HcSpec, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused op computed as ds4c.reference.model computes it (5.1, 5.2(a)-(b), (l)-(n), 5.4)."""
    eps = spec.eps
    if spec.variant == "embed_pre":
        e = inp["table"][inp["tokens"]]
        x = torch.stack([e] * spec.hc, dim=1)
    elif spec.variant == "pre":
        x = inp["x"]
    else:
        x = P.hc_post(inp["out"], inp["x"], inp["post"], inp["comb"])
    if spec.variant == "post_out":
        return {"x_new": x}
    if spec.variant == "post_head":
        y = P.hc_head(x, inp["fn"], inp["scale"], inp["base"], spec.hc_eps, spec.norm_eps)
        return {"y": P.rms_norm(y, inp["norm_w"], eps)}
    y, post, comb = P.hc_pre(x, inp["fn"], inp["scale"], inp["base"], spec.iters, spec.hc_eps, spec.norm_eps)
    out = {} if spec.variant == "pre" else {"x" if spec.variant == "embed_pre" else "x_new": x}
    return {**out, "y": P.rms_norm(y, inp["norm_w"], eps), "post_new": post, "comb_new": comb}


def _ir_ops(spec: H.HcSpec, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused op computed by the IR interpreter's implementations of its member ops (passes/fuse_hc.py)."""
    from ds4c.ir.ops import OPS

    def run(kind: str, ins: list, **attrs) -> list:
        return OPS[kind].run(None, ins, attrs)

    if spec.variant == "embed_pre":
        (e,) = run("embed", [inp["tokens"], inp["table"]])
        (x,) = run("hc_expand", [e], hc=spec.hc)
    elif spec.variant == "pre":
        x = inp["x"]
    else:
        (x,) = run("hc_post", [inp["out"], inp["x"], inp["post"], inp["comb"]])
    if spec.variant == "post_out":
        return {"x_new": x}
    (m,) = run("hc_mix", [x, inp["fn"]], eps=spec.norm_eps)
    if spec.variant == "post_head":
        (pre,) = run("hc_head_gate", [m, inp["scale"], inp["base"]], eps=spec.hc_eps)
    else:
        pre, post, comb = run("sinkhorn", [m, inp["scale"], inp["base"]], hc=spec.hc, iters=spec.iters,
                              eps=spec.hc_eps)
    (y,) = run("hc_premix", [x, pre])
    (y,) = run("rms_norm", [y, inp["norm_w"]], eps=spec.eps)
    if spec.variant == "post_head":
        return {"y": y}
    out = {} if spec.variant == "pre" else {"x" if spec.variant == "embed_pre" else "x_new": x}
    return {**out, "y": y, "post_new": post, "comb_new": comb}


@pytest.mark.parametrize("q", (1, 5))
@pytest.mark.parametrize("width", tuple(WIDTHS))
@pytest.mark.parametrize("variant", H.VARIANTS)
def test_reference_is_the_model_bit_for_bit(variant: str, width: str, q: int) -> None:
    spec = spec_of(variant, width, q)
    g = torch.Generator().manual_seed(1000 + 10 * q + WIDTHS[width] + H.VARIANTS.index(variant))
    inp = H.random_inputs(spec, g)
    ref = H.reference(spec, **inp)
    assert list(ref) == H.output_names(spec)
    for other in (_model_functions(spec, inp), _ir_ops(spec, inp)):
        assert list(other) == list(ref)
        for k in ref:
            assert ref[k].dtype == other[k].dtype and ref[k].shape == other[k].shape, k
            assert torch.equal(ref[k], other[k]), f"{variant} {k}: not bit-identical"
    shapes = H.arg_shapes(spec)
    for k, v in ref.items():
        want = shapes["x" if k == "x" else k]
        assert (tuple(v.shape), v.dtype) == want, k
    assert not any(bool(v.isnan().any()) for v in ref.values())


@pytest.mark.parametrize("variant", H.VARIANTS)
def test_kernel_model_matches_reference(variant: str) -> None:
    """The kernels' block-split sums (in torch) agree with the reference within the GPU check's tolerances."""
    spec = spec_of(variant, "official", 5)
    inp = H.random_inputs(spec, torch.Generator().manual_seed(7))
    ref, km = H.reference(spec, **inp), H.kernel_model(spec, **inp)
    for k in ref:
        err = (km[k].float() - ref[k].float()).abs().max() / ref[k].float().abs().max()
        # the block split reorders fp32 sums over the hc * hidden inputs of the mix (the rms and the mix
        # products): fp32 outputs move by that order's bound; bf16 outputs are then roundings of such values,
        # equal or one ulp (<= 2^-7 of the largest element) apart (measured: y 2e-3 on the default CPU path,
        # 3e-5 with AVX2; fp32 outputs 4e-7)
        bound = BF16_ULP if ref[k].dtype == torch.bfloat16 else fp32_order_bound(spec.hc * spec.hidden)
        assert err <= bound, f"{k}: {err} > {bound}"


def test_embed_pre_streams_are_copies() -> None:
    spec = spec_of("embed_pre", "tiny", 3)
    inp = H.random_inputs(spec, torch.Generator().manual_seed(3))
    x = H.reference(spec, **inp)["x"]
    for c in range(spec.hc):
        assert torch.equal(x[:, c], inp["table"][inp["tokens"]])
