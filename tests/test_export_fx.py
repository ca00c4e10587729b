"""The step graph traced into a ``torch.export`` program (ds4c.export.fx, ds4c.export.lowerings), which needs no
torch-mlir: the static lowerings against ds4c's own primitives, the traced step against the IR interpreter (bit for
bit at width 1 in the spec's bf16 dataflow with quant emulation; at fp32 roundoff at widths 1..5, a prefill chunk,
a layer-split shard and a fused graph), the one-line refusals, and the weights side file.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

import pytest
import torch

from ds4c import quant as Q
from ds4c.config import preset
from ds4c.errors import ExportError, ModelFileError
from ds4c.export.fx import check_exportable, trace_step
from ds4c.export.lowerings import (MAX_TOPK_CANDIDATES, act_quant_dequant, e2m1_round, e4m3_round, fp4_fake_quant,
                                   fp8_fake_quant, pow2_ceil_scale, scatter_last, topk_lower_index)
from ds4c.export.step import step_graph
from ds4c.export.weights import BANK_PARTS, ModelWeights, TensorInfo, weight_infos, write_safetensors
from ds4c.sources import open_model
from ds4c.ir import build_step
from ds4c.passes.manager import run_pipeline
from ds4c.reference import ReferenceWeights
from ds4c.reference import primitives as P

import export_check as X
from export_check import fp32_weights, tokens  # noqa: F401  (fixtures)

TINY = preset("tiny")


def _run_program(sp):
    """The traced program as a function of its arguments (step inputs, then the weights)."""
    return sp.program.module()


# ------------------------------------------------------------------------------------------------ lowerings

def _scores(gen, shape, dtype):
    """Random scores with many ties (values from a small set) and some -inf."""
    s = torch.randint(-6, 7, shape, generator=gen).to(torch.float32) * 0.25
    s = s + torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.5)
    s = s.masked_fill(torch.rand(shape, generator=gen) < 0.1, float("-inf"))
    return s.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_lower_index_equals_the_stable_sort(dtype):
    gen = torch.Generator().manual_seed(11)
    for n, k in ((7, 3), (64, 8), (1000, 64), (5, 5)):
        s = _scores(gen, (6, 3, n), dtype)
        s[0, 0, :] = 0.0  # all equal: index order
        s[0, 1, :] = float("-inf")
        s[0, 2, : n // 2] = -0.0  # signed zeros tie with zeros
        assert torch.equal(topk_lower_index(s, k), P.topk_lower_index(s, k))
    # extreme magnitudes keep their order (the subtracted term scales with |s|)
    s = torch.tensor([[3e38, -3e38, 1e-38, -1e-38, 1e-45, 3e38, 0.0]])
    assert torch.equal(topk_lower_index(s, 7), P.topk_lower_index(s, 7))


def test_topk_lower_index_refuses_more_candidates_than_its_keys_hold():
    with pytest.raises(ExportError, match=f"at most {MAX_TOPK_CANDIDATES}"):
        topk_lower_index(torch.zeros(MAX_TOPK_CANDIDATES + 1), 1)


def _activations(gen, rows, k):
    """bf16 rows with per-block magnitudes from 2^-20 to 2^12 (exercising the scale table and the floors)."""
    x = torch.randn(rows, k, generator=gen)
    mag = 2.0 ** torch.randint(-20, 13, (rows, k // 32), generator=gen).to(torch.float32)
    return (x * mag.repeat_interleave(32, dim=1)).to(torch.bfloat16)


def test_quant_lowerings_equal_ds4c_quant_bit_for_bit():
    """The frexp-free, float8-free arithmetic of the lowerings gives ds4c.quant's values exactly."""
    gen = torch.Generator().manual_seed(12)
    x = _activations(gen, 64, 512)
    assert torch.equal(fp8_fake_quant(x, 64), Q.fp8_fake_quant(x, 64))
    assert torch.equal(fp4_fake_quant(x, 32), Q.fp4_fake_quant(x, 32))
    assert torch.equal(act_quant_dequant(x, 128), Q.act_quant_dequant(x, 128))
    amax = torch.cat([x.float().abs().flatten()[:4096], torch.tensor([448.0, 448.0001, 6.0, 1e-30, 3e38])])
    for qmax in (Q.FP8_E4M3_MAX, Q.FP4_E2M1_MAX):
        assert torch.equal(pow2_ceil_scale(amax, qmax), Q.pow2_ceil_scale(amax, qmax))
    z = (torch.rand(100000, generator=gen) * 2 - 1) * 448
    z = torch.cat([z, torch.tensor([0.0, 448.0, -448.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 0.5, 240.0, 248.0])])
    assert torch.equal(e4m3_round(z), z.to(torch.float8_e4m3fn).to(torch.float32))
    y = torch.cat([(torch.rand(100000, generator=gen) * 2 - 1) * 7, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5,
                                                                                   5.0, -0.25, -5.0, 6.0, -0.0])])
    assert torch.equal(e2m1_round(y), Q.e2m1_round(y))


def test_scatter_last_writes_rows_in_order():
    gen = torch.Generator().manual_seed(13)
    buf = torch.randn(8, 3, generator=gen).to(torch.bfloat16)
    idx = torch.tensor([2, 5, 2, 7, 0, 5])
    vals = torch.randn(6, 3, generator=gen)
    ok = torch.tensor([True, True, True, False, True, True])
    want = buf.clone()
    for i in range(6):
        if ok[i]:
            want[idx[i]] = vals[i].to(torch.bfloat16)
    assert torch.equal(scatter_last(buf, idx, vals, ok), want)


# ------------------------------------------------------------------------------------------------ the traced step

def test_traced_step_equals_the_interpreter_bit_for_bit_at_width_1(tiny_weights, tiny_path, tokens):
    """Width 1 in the spec's dataflow (bf16, FP8 / FP4 fake quantization): a one-row step has no row-wise /
    batched difference, so the traced program reproduces the interpreter exactly over 40 positions: ring wraps,
    compressor flushes (ratios 4 and 16), the indexer top-k over more candidates than it keeps, the hash and the
    scored routers."""
    g = step_graph(TINY, 1, ctx=X.MAX_CTX)
    sp = trace_step(g, TINY, "external", dataflow="bf16")
    mw = ModelWeights(open_model(tiny_path), "bf16")
    wv = [mw.tensor(w) for w in sp.weights]
    run = _run_program(sp)
    X.step_alongside(g, tiny_weights, lambda *a: run(*a, *wv), list(g.inputs), tokens, tol=None)


@pytest.mark.slow
@pytest.mark.parametrize("case", X.cases(["q1", "q2", "q3-fused", "q4", "q5", "prefill8", "shard2:4-q3"],
                                         ["q3-fused", "q5", "prefill8", "shard2:4-q3"]))
def test_traced_step_equals_the_interpreter_at_fp32_roundoff(fp32_weights, tiny_path, tokens, case):
    """fp32 dataflow, no fake quantization: the traced step (all rows at once) equals the interpreter (row by row)
    within :func:`export_check.fp32_reorder_bound` on logits and every state output, from a reset state over 40
    positions. ``q3-fused``: the graph after the whole default pipeline (fused ops export as their bodies);
    ``prefill8``: a chunk of 8 rows holding 5..8 tokens (padding rows computed, never kept); ``shard2:4``: the
    layer-split shard of layers 2 and 3 (hc_in fresh random data)."""
    cfg = fp32_weights.config
    after = "plan_memory" if case == "q3-fused" else "pad_compressed_kv"
    layers = (2, 4) if case.startswith("shard") else None
    if case.startswith("prefill"):
        g = step_graph(cfg, prefill=8, ctx=X.MAX_CTX)
        rows = lambda p: 5 + (p // 8) % 4  # noqa: E731  5, 6, 7, 8 tokens
    else:
        g = step_graph(cfg, int(case.split("q")[-1][0]), ctx=X.MAX_CTX, layers=layers, after=after)
        rows = None
    sp = trace_step(g, cfg, "external", dataflow="fp32")
    mw = ModelWeights(open_model(tiny_path), "fp32")
    wv = [mw.tensor(w) for w in sp.weights]
    run = _run_program(sp)
    worst = X.step_alongside(g, fp32_weights, lambda *a: run(*a, *wv), list(g.inputs), tokens,
                             tol=X.fp32_reorder_bound(cfg), rows=rows)
    assert set(worst) == set(g.outputs)
    # the rows were really batched: a bit-for-bit equality would mean the test compared a row-wise program
    assert case == "q1" or max(worst.values()) > 0


# ------------------------------------------------------------------------------------------------ refusals

def test_export_names_the_ops_without_a_lowering():
    g = run_pipeline(build_step(TINY, 2, X.MAX_CTX), ["canonicalize", "fix_verify_width"]).graph
    with pytest.raises(ExportError, match=r"^cannot export: no lowering for IR op live_rows \(layers 2, 3, 4, 5\): "
                                          r"its span grows with the position.*pad_compressed_kv$"):
        check_exportable(g)
    g = build_step(TINY, 2, X.MAX_CTX)  # before fix_verify_width
    with pytest.raises(ExportError, match=r"no lowering for IR op live_rows"):
        check_exportable(g)
    swa = build_step(TINY, 2, X.MAX_CTX, layers=(0, 2))  # no compressed span, the width still the symbol q
    with pytest.raises(ExportError, match=r"symbolic dims q in the graph's inputs or outputs; export after "
                                          r"fix_verify_width"):
        check_exportable(swa)
    big = step_graph(preset("flash-l4"), 1, ctx=1 << 18)  # 65536 indexer keys per CSA layer
    with pytest.raises(ExportError, match=r"no lowering for IR op indexer_topk \(layers 1, 3\): a top-k over 65536 "
                                          r"compressed rows, the export's unique keys hold at most 32768: a smaller ctx"):
        check_exportable(big)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"weights_mode": "lazy"}, r"weights must be one of inline, external, none, found 'lazy'"),
    ({"dataflow": "fp16"}, r"dataflow must be one of \['bf16', 'fp32'\], found 'fp16'"),
    ({"weights_mode": "inline"}, r"weights inline: the weight values are needed"),
])
def test_trace_step_refuses_bad_options(kwargs, pattern):
    g = step_graph(TINY, 1, ctx=X.MAX_CTX)
    with pytest.raises(ExportError, match=pattern):
        trace_step(g, TINY, **kwargs)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"width": 2, "prefill": 8}, r"a width .* or a prefill chunk, not both"),
    ({"prefill": 200}, r"a prefill chunk must have 1\.\.128 rows \(at most the context 128\), found 200"),
    ({"after": "canonicalize"}, r"after must be one of pad_compressed_kv, fuse_hc, .*plan_memory.*found 'canonicalize'"),
    ({"width": 6}, r"step width must be in 1\.\.5, found 6"),
    ({"layers": (4, 9)}, r"layer"),
])
def test_step_graph_refuses_bad_options(kwargs, pattern):
    with pytest.raises(Exception, match=pattern) as e:
        step_graph(TINY, ctx=X.MAX_CTX, **kwargs)
    assert isinstance(e.value, Exception) and type(e.value).__module__ == "ds4c.errors"


# ------------------------------------------------------------------------------------------------ weights

def test_weight_infos_and_the_side_file(tiny_path, tmp_path):
    """Every param the graph reads (expert banks as their three stacked GGUF tensors), written to safetensors a
    tensor at a time and read back by the safetensors library equal to the reference's values."""
    safetensors = pytest.importorskip("safetensors.torch", reason="the safetensors reader (requirements-cpu.txt)")
    g = step_graph(TINY, 1, ctx=X.MAX_CTX, layers=(2, 4))
    infos = weight_infos(g, TINY)
    names = [i.name for i in infos]
    assert len(names) == len(set(names))
    assert {f"blk.{i}.{p}" for i in (2, 3) for p in BANK_PARTS} <= set(names)
    assert all(n.startswith(("blk.2.", "blk.3.")) for n in names)
    mf = open_model(tiny_path)
    mw = ModelWeights(mf, "bf16")
    out = tmp_path / "w.safetensors"
    write_safetensors(out, infos, mw, metadata={"config": "tiny"})
    back = safetensors.load_file(str(out))
    assert set(back) == set(names)
    ref = ReferenceWeights.load(mf, layers=(2, 4))
    for i in infos:
        t = back[i.name]
        assert t.dtype == i.dtype and tuple(t.shape) == i.shape
        if i.name.endswith(BANK_PARTS):
            e = 5
            assert torch.equal(t[e], mf.expert(i.name, e, torch.float32))
        else:
            assert torch.equal(t, ref.by_name[i.name]), i.name  # wo_a rounded to bf16 values as the reference has it
    with open(out, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        assert n % 8 == 0 and b'"__metadata__":{"config":"tiny"}' in f.read(n)


def test_side_file_is_whole_or_absent(tiny_path, tmp_path):
    """A write that fails midway (a weight missing from the model) leaves neither the file nor a temporary."""
    g = step_graph(TINY, 1, ctx=X.MAX_CTX)
    infos = weight_infos(g, TINY)
    bad = infos[:3] + [TensorInfo("blk.0.no_such.weight", (4,), torch.float32)] + infos[3:]
    out = tmp_path / "w.safetensors"
    with pytest.raises(ModelFileError, match="no_such"):
        write_safetensors(out, bad, ModelWeights(open_model(tiny_path)))
    assert list(tmp_path.iterdir()) == []


SLOW_SIDE_FILE = r"""
import sys, time
from ds4c.export.step import step_graph
from ds4c.export.weights import ModelWeights, weight_infos, write_safetensors
from ds4c.config import preset
from ds4c.sources import open_model
class Slow(ModelWeights):
    def chunks(self, info):
        print("tensor", info.name, flush=True)
        time.sleep(0.01)
        yield from super().chunks(info)
g = step_graph(preset("tiny"), 1, ctx=64)
write_safetensors(sys.argv[2], weight_infos(g, preset("tiny")), Slow(open_model(sys.argv[1])))
"""


def test_sigkill_while_writing_the_side_file_leaves_the_old_one_and_the_next_write_sweeps(tiny_path, tmp_path):
    out = tmp_path / "s.safetensors"
    out.write_bytes(b"the previous export")
    p = subprocess.Popen([sys.executable, "-c", SLOW_SIDE_FILE, str(tiny_path), str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    for _ in range(20):
        assert p.stdout.readline().startswith("tensor"), "the writer ended before the kill point"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    left = [x.name for x in tmp_path.iterdir() if x.name != out.name]
    assert len(left) == 1 and left[0].startswith(f"s.safetensors.tmp-{p.pid}-"), left  # owned: pid + host
    assert out.read_bytes() == b"the previous export"
    g = step_graph(TINY, 1, ctx=64)
    write_safetensors(out, weight_infos(g, TINY), ModelWeights(open_model(tiny_path)))
    assert [x.name for x in tmp_path.iterdir()] == [out.name]  # the dead writer's temporary swept
    with open(out, "rb") as f:
        assert struct.unpack("<Q", f.read(8))[0] > 0
