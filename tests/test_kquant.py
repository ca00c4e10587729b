"""Tests of the K-quant and IQ4_XS formats (issue 14 part 2): dequantization bit-identical to gguf.quants (random
bytes, fp16 subnormal scales, every byte value at every position), size and error messages, the per-tensor
storage rule (Q8_0 for rows that are not whole super-blocks), a tiny model file holding K-quant tensors (opens,
validates, the reference generates from it with logits bit-equal to the same model stored F32), ``ds4c info`` on
it, the byte model of the kernel plan, and the compiled engine's one-line refusal."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import quants as gq

from ds4c import quant as Q
from ds4c.cli import main
from ds4c.config import preset
from ds4c.errors import ConfigError, ModelFileError, QuantError
from ds4c.gguf_file import write_model
from ds4c.sources import open_model
from ds4c.quant import GGMLType as G
from ds4c.reference import Reference, ReferenceWeights
from ds4c.synth import make_model, producer
from ds4c.tensors import (ACCEPTED_TYPES, FORMATS, ROLE_BF16, ROLE_FP4, ROLE_FP8, storage_type, storage_types,
                          tensor_specs)

TINY = preset("tiny")
KTYPES = (G.Q2_K, G.Q3_K, G.Q4_K, G.Q5_K, G.Q6_K, G.IQ4_XS)
SIZES = {G.Q2_K: 84, G.Q3_K: 110, G.Q4_K: 144, G.Q5_K: 176, G.Q6_K: 210, G.IQ4_XS: 136}
# byte offsets of the fp16 fields of each super-block (llama.cpp's block_q*_K / block_iq4_xs)
F16_AT = {G.Q2_K: (80, 82), G.Q3_K: (108,), G.Q4_K: (0, 2), G.Q5_K: (0, 2), G.Q6_K: (208,), G.IQ4_XS: (0,)}


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def set_f16(blocks: np.ndarray, t: G, values: np.ndarray) -> np.ndarray:
    """Write fp16 ``values`` ([n_blocks, n_fields]) into the fp16 fields of super-blocks ``blocks`` [n, size]."""
    for j, at in enumerate(F16_AT[t]):
        blocks[:, at:at + 2] = values[:, j].astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks


def random_blocks(rng: np.random.Generator, t: G, n: int, f16: str = "normal") -> np.ndarray:
    b = rng.integers(0, 256, size=(n, SIZES[t]), dtype=np.uint8)
    k = len(F16_AT[t])
    if f16 == "normal":  # signed, magnitudes 2^-14 .. 2^10
        v = rng.choice([-1.0, 1.0], (n, k)) * np.exp2(rng.uniform(-14, 10, (n, k)))
    else:  # fp16 subnormals (raw bits 1..1023, either sign)
        v = (rng.integers(1, 1024, (n, k), dtype=np.uint16) | (rng.integers(0, 2, (n, k), dtype=np.uint16) << 15)
             ).view(np.float16)
    return set_f16(b, t, np.asarray(v))


# ------------------------------------------------------------------------------------------------ formats

def test_table_matches_gguf():
    from gguf import GGML_QUANT_SIZES

    assert set(Q.SUPER_BLOCKS) == set(KTYPES)
    for t in KTYPES:
        sb = Q.super_block(t)
        assert (sb.values, sb.nbytes) == GGML_QUANT_SIZES[t] == (256, SIZES[t]) == Q.BLOCK[t]
        assert sb.name == t.name.lower() and Q.SUPER_BLOCK_NAMES[sb.name] == t
        assert Q.super_block(sb.name) is sb and Q.super_block(int(t)) is sb and Q.super_block(t.name) is sb
        assert t in Q.SUPPORTED_TYPES and Q.is_super_block(t) and Q.nbytes(t, (3, 512)) == 6 * SIZES[t]
    assert not Q.is_super_block(G.Q8_0) and not Q.is_super_block(G.MXFP4)
    with pytest.raises(QuantError, match="MXFP4 is not a super-block"):
        Q.super_block(G.MXFP4)


@pytest.mark.parametrize("t", KTYPES, ids=lambda t: t.name)
def test_dequantize_bit_identical_to_gguf(t):
    """Random bytes with normal and with subnormal fp16 scales, and a block set where every byte position takes
    every value 0..255 (all nibbles, 2-bit fields, hmask bits, 6-bit scales, int8 scales), scales kept finite."""
    rng = np.random.default_rng(int(t))
    cases = [random_blocks(rng, t, 512), random_blocks(rng, t, 256, "subnormal")]
    pos = np.arange(SIZES[t], dtype=np.int64)
    every = ((np.arange(256)[:, None] * 1 + pos[None, :] * 37) % 256).astype(np.uint8)  # column j: all 256 values
    cases.append(set_f16(every, t, rng.uniform(0.5, 2, (256, len(F16_AT[t]))).astype(np.float32)))
    for blocks in cases:
        raw = blocks.reshape(-1, 2 * SIZES[t])  # rows of 512 values
        want = gq.dequantize(raw, t)
        got = Q.dequantize(raw, t, want.shape)
        assert got.dtype == torch.float32 and bits_equal(got.numpy(), want), t.name
        assert (got.numpy() != 0).any()
    # another dtype of the same bytes, a 3-d shape, bf16 output
    raw = cases[0].reshape(4, 32, 4 * SIZES[t])
    want = gq.dequantize(raw, t)
    assert bits_equal(Q.dequantize(torch.from_numpy(raw.copy()).view(torch.int16), t, (4, 32, 1024)).numpy(), want)
    assert torch.equal(Q.dequantize(raw, t, (4, 32, 1024), dtype=torch.bfloat16),
                       torch.from_numpy(want).to(torch.bfloat16))


def test_dequantize_in_chunks(monkeypatch):
    """Tensors larger than one chunk go through the chunked path with the same result."""
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, G.Q4_K, 40).reshape(10, 4 * 144)
    want = gq.dequantize(raw, G.Q4_K)
    monkeypatch.setattr(Q, "_CHUNK_ELEMS", 256 * 3)
    assert bits_equal(Q.dequantize(raw, G.Q4_K, (10, 1024)).numpy(), want)


def test_hand_values():
    """One Q4_K and one Q6_K super-block decoded by hand from the layouts of the module docstring."""
    b = np.zeros(144, np.uint8)
    set_f16(b[None], G.Q4_K, np.array([[0.5, 0.25]], np.float32))
    b[4], b[8] = 3, 2  # sub-block 0: scale 3 (scales[0] & 63), min 2 (scales[4] & 63)
    b[15], b[7] = 0x21, 0x80  # sub-block 7: scale (scales[11] & 15) | (scales[3] >> 6) << 4 = 33, min 0x21 >> 4 = 2
    b[16] = 0x5A  # value 0: low nibble 10; value 32 (sub-block 1): high nibble 5
    b[16 + 96 + 31] = 0xF0  # value 255: sub-block 7, high nibble of qs[96 + 31] = 15
    v = Q.dequantize(b, G.Q4_K, (256,))
    assert v[0] == 0.5 * 3 * 10 - 0.25 * 2
    assert v[32] == 0.0 and v[1] == -0.5  # sub-block 1 has scale 0 / min 0; value 1: q 0 -> -dmin*m
    assert v[255] == 0.5 * 33 * 15 - 0.25 * 2
    b6 = np.zeros(210, np.uint8)
    set_f16(b6[None], G.Q6_K, np.array([[2.0]], np.float32))
    b6[192] = 0xFF  # scale of values 0..15: int8 -1
    b6[0], b6[128] = 0x07, 0x02  # value 0: low 7 | (2 << 4) = 39 -> q = 7
    assert Q.dequantize(b6, G.Q6_K, (256,))[0] == 2.0 * -1 * 7
    assert Q.dequantize(b6, G.Q6_K, (256,))[16] == 2.0 * 0 * -32


def test_errors_are_one_line():
    with pytest.raises(QuantError) as ei:
        Q.nbytes(G.Q3_K, (4, 128))
    msg = str(ei.value)
    assert "\n" not in msg and "multiple of the block size 256, found 128" in msg and "Q8_0" in msg
    with pytest.raises(QuantError, match="last dim must be a multiple of the block size 256"):
        Q.dequantize(np.zeros(110, np.uint8), G.Q3_K, (2, 128))
    with pytest.raises(QuantError) as ei:
        Q.dequantize(np.zeros(143, np.uint8), G.Q4_K, (256,))
    assert "\n" not in str(ei.value) and "expected 144 bytes, found 143" in str(ei.value)
    for t in KTYPES:
        with pytest.raises(QuantError) as ei:
            Q.quantize(torch.zeros(2, 256), t)
        msg = str(ei.value)
        assert "\n" not in msg and f"reads {t.name} but does not quantize" in msg and "llama-quantize" in msg


# ------------------------------------------------------------------------------------------------ roles

def test_roles_and_storage_types():
    for t in KTYPES:
        assert t in ACCEPTED_TYPES[ROLE_FP4] and t in ACCEPTED_TYPES[ROLE_FP8] and t in ACCEPTED_TYPES[ROLE_BF16]
        assert t not in ACCEPTED_TYPES["norm"] and t not in ACCEPTED_TYPES["f32"]
        name = t.name.lower()
        assert FORMATS[name] == {**FORMATS["official"], ROLE_FP4: t}
        types = storage_types(TINY, name)
        for s in tensor_specs(TINY):
            want = FORMATS["official"][s.role]
            if s.role == ROLE_FP4:
                want = G.Q8_0 if s.name.endswith("ffn_down_exps.weight") else t  # tiny: w2 rows of 128
            assert types[s.name] == want, s.name
    assert G.Q8_0 in ACCEPTED_TYPES[ROLE_BF16]
    assert storage_types(TINY, "official") == {s.name: FORMATS["official"][s.role] for s in tensor_specs(TINY)}
    flash = storage_types(preset("flash"), "q2_k")  # DeepSeek-V4-Flash: every row a multiple of 256
    assert {flash[s.name] for s in tensor_specs(preset("flash")) if s.role == ROLE_FP4} == {G.Q2_K}
    spec = next(s for s in tensor_specs(TINY) if s.name == "blk.0.attn_q_b.weight")  # rows of 128
    assert storage_type(spec, {ROLE_FP8: G.Q6_K}) == G.Q8_0 and storage_type(spec, {ROLE_FP8: G.BF16}) == G.BF16
    with pytest.raises(ConfigError, match="unknown formats 'q7_k'"):
        storage_types(TINY, "q7_k")


def test_make_model_writes_k_formats(tmp_path):
    """make-model --formats q3_k / iq4_xs: routed experts in that type (tiny's w2, rows of 128, in Q8_0), the
    rest official; values sane (finite, RMS near the generator's target) through ds4c's and gguf's decoders."""
    import gguf

    path = make_model(TINY, tmp_path / "x.gguf", formats="q3_k")
    mf = open_model(path)
    assert mf.ggml_type("blk.0.ffn_gate_exps.weight") == G.Q3_K and mf.ggml_type("blk.0.ffn_down_exps.weight") == G.Q8_0
    assert mf.ggml_type("blk.0.attn_q_a.weight") == G.Q8_0
    w = mf.expert("blk.2.ffn_up_exps.weight", 3)
    raw = np.ascontiguousarray(mf.raw("blk.2.ffn_up_exps.weight"))[3]
    assert np.array_equal(w.numpy(), gguf.quants.dequantize(raw, G.Q3_K).astype(np.float32))
    assert torch.isfinite(w).all() and 0.5 < float(w.square().mean().sqrt()) * TINY.hidden_size ** 0.5 < 2.0
    r = CliRunner().invoke(main, ["make-model", "--preset", "tiny", "--formats", "iq4_xs", "-o", str(tmp_path / "y")],
                           env={"DS4C_HOME": str(tmp_path / "home")})
    assert r.exit_code == 0, r.output
    assert open_model(tmp_path / "y").ggml_type("blk.5.ffn_gate_exps.weight") == G.IQ4_XS


# ------------------------------------------------------------------------------------------------ model files

# role -> type of the two test files: K-quant experts (Q8_0 for tiny's w2), K-quant FP8-role and BF16-role
# matrices where their rows are whole super-blocks (Q8_0 elsewhere), official otherwise
FILE_TYPES = {
    "a": {**FORMATS["official"], ROLE_FP4: G.Q3_K, ROLE_FP8: G.Q6_K, ROLE_BF16: G.Q5_K},
    "b": {**FORMATS["official"], ROLE_FP4: G.IQ4_XS, ROLE_FP8: G.Q2_K, ROLE_BF16: G.Q4_K},
}
F32_TYPES = {**FORMATS["official"], ROLE_FP4: G.F32, ROLE_FP8: G.F32, ROLE_BF16: G.F32}


@pytest.fixture(scope="module")
def kfiles(tmp_path_factory):
    d = tmp_path_factory.mktemp("kquant")
    from ds4c.synth_vocab import synthetic_vocab

    return {k: write_model(d / f"{k}.gguf", TINY, types, producer(TINY, 3), tokenizer=synthetic_vocab(512, 0))
            for k, types in FILE_TYPES.items()}


@pytest.mark.parametrize("which", sorted(FILE_TYPES))
def test_file_opens_and_reads(kfiles, which):
    mf = open_model(kfiles[which])
    types = storage_types(TINY, FILE_TYPES[which])
    assert {n: mf.ggml_type(n) for n in mf.specs} == types
    assert len(set(types.values()) & set(KTYPES)) == 3
    by_type = mf.weight_bytes_by_type()
    for t in set(types.values()):
        names = [n for n, x in types.items() if x == t]
        assert by_type[t.name] == (len(names), sum(Q.nbytes(t, mf.specs[n].shape) for n in names))
    for name in ("blk.1.ffn_gate_exps.weight", "blk.2.attn_kv.weight", "token_embd.weight"):
        t = mf.ggml_type(name)
        assert Q.is_super_block(t), name
        raw = np.asarray(mf.raw(name))
        shape = mf.specs[name].shape
        want = gq.dequantize(raw, t).reshape(shape)
        assert raw.nbytes == Q.nbytes(t, shape)
        assert bits_equal(mf.tensor(name).numpy(), want)
        if len(shape) == 3:
            assert bits_equal(mf.expert(name, 5).numpy(), want[5])
    assert mf.file_type == {"a": "MOSTLY_Q3_K_M", "b": "MOSTLY_IQ4_XS"}[which]


def test_reference_equals_f32_copy(kfiles, tmp_path):
    """The reference dequantizes to fp32: the K-quant file and the same model stored F32 give bit-equal logits
    (a prompt as one verify step, then decodes) and the same greedy tokens."""
    from ds4c.generate import generate

    mf = open_model(kfiles["a"])

    def produce_f32(spec, t):
        yield np.asarray(mf.raw(spec.name)) if t == G.I32 else mf.tensor(spec.name).numpy()

    f32 = write_model(tmp_path / "f32.gguf", TINY, F32_TYPES, produce_f32)
    runs = []
    for path in (kfiles["a"], f32):
        ref = Reference(ReferenceWeights.load(open_model(path)), max_ctx=64)
        logits = [ref.verify([5, 17, 300, 2, 99], 0)]
        tok = int(logits[-1][-1].argmax())
        for pos in range(5, 8):
            logits.append(ref.decode(tok, pos))
            tok = int(logits[-1][-1].argmax())
        runs.append((torch.cat(logits), generate(ref, [5, 17, 300], 6).tokens))
    (la, ta), (lb, tb) = runs
    assert torch.isfinite(la).all() and la.std() > 0
    assert torch.equal(la.view(torch.int32), lb.view(torch.int32))
    assert ta == tb and len(ta) == 6


def test_wrong_k_type_for_role_is_one_line(kfiles, tmp_path):
    """A K-quant where a role accepts none (a norm gain) names the tensor, the type and the types expected; rows
    that are not whole super-blocks name the tensor."""
    from test_gguf import copy_model

    src = open_model(kfiles["a"])
    name = "blk.0.attn_norm.weight"
    blk = random_blocks(np.random.default_rng(0), G.Q4_K, 1).reshape(-1)
    p = copy_model(src, tmp_path / "norm.gguf", replace={name: (blk, G.Q4_K)})  # the [256] gain as one Q4_K block
    with pytest.raises(ModelFileError) as ei:
        open_model(p)
    msg = str(ei.value)
    assert "\n" not in msg and f"{name!r} has type Q4_K" in msg and "role norm" in msg
    assert ", ".join(x.name for x in ACCEPTED_TYPES["norm"]) in msg
    # the same tensor info claiming rows of 128 values (gguf's writer cannot write it: patch ne[0])
    data = bytearray(p.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(key) + len(key)
    assert int.from_bytes(data[at:at + 4], "little") == 1 and int.from_bytes(data[at + 4:at + 12], "little") == 256
    data[at + 4:at + 12] = (128).to_bytes(8, "little")
    (tmp_path / "rows.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as ei:
        open_model(tmp_path / "rows.gguf")
    msg = str(ei.value)
    assert "\n" not in msg
    assert f"{name!r} of type Q4_K has rows of 128 values, not a multiple of its block of 256" in msg


def test_info_shows_k_types(kfiles):
    r = CliRunner().invoke(main, ["info", str(kfiles["b"]), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    by_type = open_model(kfiles["b"]).weight_bytes_by_type()
    assert {k: (v["count"], v["bytes"]) for k, v in rec["tensors"].items()} == by_type
    assert {"IQ4_XS", "Q2_K", "Q4_K", "Q8_0"} <= set(rec["tensors"]) and rec["file_type"] == "MOSTLY_IQ4_XS"
    assert rec["tensors"]["IQ4_XS"]["count"] == 2 * TINY.n_layers  # w1, w3 (w2: Q8_0)
    text = CliRunner().invoke(main, ["info", str(kfiles["b"])], catch_exceptions=False).stdout
    for name, (n, b) in by_type.items():
        assert re.search(rf"^\s+{name}\s+{n}\s+tensors\s+{b:,d} bytes", text, re.M), (name, text)


def test_plan_bytes_use_stored_types(kfiles):
    """The roofline byte model (kernel plan weight bytes) counts each tensor in its stored type."""
    from ds4c.bench import plan_weight_bytes

    mf = open_model(kfiles["a"])
    total, _, per_kernel = plan_weight_bytes(mf, 1, 64, 64, {i: 1 for i in range(TINY.n_layers)})
    E, F, D = TINY.n_experts, TINY.moe_inter, TINY.hidden_size
    one_expert = 2 * Q.nbytes(G.Q3_K, (F, D)) + Q.nbytes(G.Q8_0, (D, F))
    shared = sum(Q.nbytes(mf.ggml_type(f"blk.0.ffn_{k}_shexp.weight"), mf.specs[f"blk.0.ffn_{k}_shexp.weight"].shape)
                 for k in ("gate", "up", "down"))
    experts = [v for k, v in per_kernel.items() if k.startswith("l0.") and "moe" in k or k == "l0.moe_experts"]
    assert one_expert + shared in experts, per_kernel
    assert total == sum(per_kernel.values())


def test_compiled_experts_accept_k_quants_other_types_refused_in_one_line(kfiles):
    """The experts kernels read K-quant banks (file "a": Q3_K gate/up, Q8_0 down); an expert stored F32 is
    still a one-line refusal naming it."""
    from ds4c.runtime.lower_step import check_expert_formats
    from ds4c.runtime.lowered import LoweringError

    mf = open_model(kfiles["a"])
    types = {n: mf.ggml_type(n) for n in mf.specs}
    assert types["blk.0.ffn_gate_exps.weight"] == G.Q3_K
    check_expert_formats(types)
    with pytest.raises(LoweringError) as ei:
        check_expert_formats({**types, "blk.1.ffn_up_exps.weight": G.F32})
    msg = str(ei.value)
    assert "\n" not in msg and "blk.1.ffn_up_exps.weight is F32" in msg and "--formats official" in msg


def test_lowering_names_the_tensor_and_type():
    """An experts bank whose w3 differs from w1 (one kernel phase reads both) is a one-line LoweringError naming
    the tensors and their types (before: w2 and w3 in another format were read silently in w1's; w2 now has
    its own format)."""
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph
    from ds4c.runtime.lowered import LoweringError
    from ds4c.runtime.targets import target

    g = run_pipeline(build_step(TINY, 1, max_ctx=128), "default", context=128).graph
    official = storage_types(TINY, "official")
    with pytest.raises(LoweringError) as ei:
        lower_graph(g, TINY, target("sm_90"), {**official, "blk.2.ffn_up_exps.weight": G.Q8_0})
    msg = str(ei.value)
    assert "\n" not in msg and "blk.2.ffn_gate_exps.weight MXFP4, blk.2.ffn_up_exps.weight Q8_0" in msg, msg


@pytest.mark.parametrize("which", sorted(FILE_TYPES))
@pytest.mark.parametrize("q", [1, 5])
def test_compiled_lowering_reads_k_quant_matrices(which, q):
    """Files "a" / "b" (K-quant FP8-role and BF16-role matrices: attention inputs, router, head, embedding) lower
    for the compiled step: every GEMV whose weight is a K-quant reads it in its own format (``gv_run_kq``), the
    embedding is read converted to bf16; the experts kernel reads the shared expert's K-quant gate/up and its
    Q8_0 down projection (tiny's rows of 128 cannot be K-quants) each in its own format."""
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph
    from ds4c.runtime.targets import target

    g = run_pipeline(build_step(TINY, q, max_ctx=128), "default", context=128).graph
    types = storage_types(TINY, FILE_TYPES[which])
    assert Q.is_super_block(types["blk.0.ffn_gate_shexp.weight"]) and types["blk.0.ffn_down_shexp.weight"] == G.Q8_0
    kq = {n for n, t in types.items() if Q.is_super_block(t) and "_exps." not in n}
    assert {"blk.0.attn_q_a.weight", "output.weight", "token_embd.weight"} <= kq
    gemv_kq = 0
    for k in lower_graph(g, TINY, target("sm_90"), types):
        for la in k.launches:
            raw = [a.name for a in la.args if a.kind == "weight" and a.form == "raw" and a.name in kq]
            if raw and la.kernel.family == "gemv":
                gemv_kq += 1
                assert "gv_run_kq<" in la.kernel.source, (k.name, raw)
            assert not (raw and la.kernel.family not in ("gemv", "experts")), (k.name, raw)
    assert gemv_kq >= 2 * TINY.n_layers + 1  # per layer the attention inputs and the router; the head