"""Tests of ds4c.quant: GGUF Q8_0 / MXFP4 layouts (byte identity with gguf.quants), DeepSeek fake-quant
primitives (spec ds4-flash.md 2.3, P3, P4) and the DeepSeek FP4 <-> MXFP4 repack."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf import quants as gq

from ds4c import quant as Q
from ds4c.errors import QuantError

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand_blocks(seed: int, rows: int, k: int, dtype=torch.float32) -> torch.Tensor:
    """Normal data with a different magnitude per 32-block (2^-20 .. 2^20) so scales vary a lot."""
    g = gen(seed)
    x = torch.randn(rows, k, generator=g)
    mag = torch.exp2(torch.randint(-20, 21, (rows, k // 32, 1), generator=g).float())
    return (x.view(rows, k // 32, 32) * mag).view(rows, k).to(dtype)


def bits_equal(a, b) -> bool:
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def ref_e2m1_rne(v: np.ndarray) -> np.ndarray:
    """Brute force: nearest e2m1 magnitude, ties to the even code (even mantissa)."""
    mags = E2M1[:8].astype(np.float64)
    v = np.asarray(v, np.float32)
    shape = v.shape
    v = v.reshape(-1)
    a = np.abs(v.astype(np.float64))[:, None]
    dist = np.abs(a - mags[None, :])
    best = dist.min(axis=1, keepdims=True)
    cand = dist == best
    even = cand & (np.arange(8)[None, :] % 2 == 0)
    idx = np.where(even.any(axis=1), even.argmax(axis=1), cand.argmax(axis=1))
    return (np.sign(v) * mags[idx]).astype(np.float32).reshape(shape)


# ----------------------------------------------------------------------------------------------------------
# types, sizes, errors
# ----------------------------------------------------------------------------------------------------------


def test_type_ids_and_blocks():
    assert (int(Q.GGMLType.F32), int(Q.GGMLType.F16), int(Q.GGMLType.Q8_0)) == (0, 1, 8)
    assert (int(Q.GGMLType.I32), int(Q.GGMLType.BF16), int(Q.GGMLType.MXFP4)) == (26, 30, 39)
    assert Q.BLOCK[Q.GGMLType.Q8_0] == (32, 34) and Q.BLOCK[Q.GGMLType.MXFP4] == (32, 17)
    assert Q.BLOCK[8] == (32, 34)


def test_nbytes():
    assert Q.nbytes(Q.GGMLType.F32, (3, 5)) == 60
    assert Q.nbytes(Q.GGMLType.F16, (3, 5)) == 30
    assert Q.nbytes(Q.GGMLType.BF16, (7,)) == 14
    assert Q.nbytes(Q.GGMLType.I32, (129280, 6)) == 129280 * 6 * 4
    assert Q.nbytes(Q.GGMLType.Q8_0, (4, 64)) == 4 * 2 * 34
    assert Q.nbytes(Q.GGMLType.MXFP4, (2048, 4096)) == 2048 * 128 * 17
    assert Q.nbytes(39, [256, 2048, 4096]) == 256 * 2048 * 128 * 17
    for t in (G.F32, G.F16, G.BF16, G.Q8_0, G.MXFP4):
        bs, ts = gq.GGML_QUANT_SIZES[t]
        assert Q.nbytes(t, (5, 64)) == 5 * 64 // bs * ts


def test_bad_inputs_raise_quant_error():
    with pytest.raises(QuantError, match=r"multiple of the block size 32.*found 33"):
        Q.nbytes(Q.GGMLType.Q8_0, (4, 33))
    x = torch.randn(2, 48, generator=gen(1))
    for fn in (Q.quantize_q8_0, Q.quantize_mxfp4, Q.fp4_fake_quant):
        with pytest.raises(QuantError, match=r"found 48"):
            fn(x)
    with pytest.raises(QuantError, match=r"multiple of the block size 64.*found 48"):
        Q.fp8_fake_quant(x.bfloat16())
    with pytest.raises(QuantError, match=r"multiple of the block size 128.*found 48"):
        Q.act_quant_fp8(x.bfloat16())
    with pytest.raises(QuantError, match=r"Q4_0 \(2\) is not supported"):
        Q.dequantize(np.zeros(18, np.uint8), G.Q4_0, (32,))
    with pytest.raises(QuantError, match=r"Q4_K"):
        Q.quantize(x, G.Q4_K)
    with pytest.raises(QuantError, match=r"unknown ggml type 999"):
        Q.nbytes(999, (32,))
    with pytest.raises(QuantError, match=r"expected 68 bytes, found 67"):
        Q.dequantize_q8_0(np.zeros(67, np.uint8), (64,))
    with pytest.raises(QuantError, match=r"expected 34 bytes, found 36"):
        Q.dequantize(np.zeros(36, np.uint8), G.MXFP4, (2, 32))
    with pytest.raises(QuantError, match=r"expected 16 bytes, found 12"):
        Q.dequantize(np.zeros(3, np.float32), G.F32, (4,))
    with pytest.raises(QuantError, match=r"floating-point"):
        Q.quantize_q8_0(torch.ones(32, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------------
# Q8_0
# ----------------------------------------------------------------------------------------------------------


def test_q8_0_hand_block():
    # amax = 63.5 -> d = 0.5 exactly (fp16 0x3800), q = 2x
    x = torch.zeros(32)
    x[0] = 63.5
    x[1:] = torch.tensor([0.5 * ((7 * i) % 200 - 100) / 2 for i in range(1, 32)])
    x[1:] = torch.round(x[1:] * 2) / 2
    raw = Q.quantize_q8_0(x)
    assert raw.dtype == torch.uint8 and raw.shape == (34,)
    assert raw[0].item() == 0x00 and raw[1].item() == 0x38
    assert np.array_equal(raw[2:].numpy().view(np.int8), (x * 2).numpy().astype(np.int8))
    assert torch.equal(Q.dequantize_q8_0(raw, (32,)), x)
    # d = 1/127 is not an fp16 value: stored rounded, but q uses 1/d of the fp32 d
    y = torch.linspace(-1, 1, 32)
    raw = Q.quantize_q8_0(y)
    assert raw[:2].numpy().view(np.float16)[0] == np.float16(np.float32(1) / np.float32(127))
    assert raw[2:].numpy().view(np.int8)[0] == -127 and raw[2:].numpy().view(np.int8)[-1] == 127


def test_q8_0_round_half_away_from_zero():
    x = torch.zeros(32)
    x[0] = 127.0  # d = 1, id = 1
    x[1:7] = torch.tensor([2.5, -2.5, 0.5, -0.5, 3.5, 1.49])
    q = Q.quantize_q8_0(x)[2:].numpy().view(np.int8)
    assert list(q[:7]) == [127, 3, -3, 1, -1, 4, 1]
    assert np.array_equal(Q.quantize_q8_0(x).numpy(), gq.quantize(x.numpy(), G.Q8_0))


@pytest.mark.parametrize("seed,shape", [(0, (16, 256)), (1, (3, 5, 64)), (2, (1, 4096))])
def test_q8_0_quantize_byte_identical_to_gguf(seed, shape):
    rows = int(np.prod(shape[:-1]))
    x = rand_blocks(seed, rows, shape[-1]).view(shape)
    ours = Q.quantize_q8_0(x)
    ref = gq.quantize(x.numpy(), G.Q8_0)
    assert ours.shape == ref.shape
    assert np.array_equal(ours.numpy(), ref)
    assert torch.equal(Q.quantize(x, G.Q8_0), ours)
    # numpy input, bf16 input (used as its fp32 values)
    assert np.array_equal(Q.quantize_q8_0(x.numpy()).numpy(), ref)
    xb = x.bfloat16()
    assert np.array_equal(Q.quantize_q8_0(xb).numpy(), gq.quantize(xb.float().numpy(), G.Q8_0))


def test_q8_0_dequantize_byte_identical_to_gguf():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (32, 8 * 34), dtype=np.uint8)
    raw.reshape(-1, 34)[:, 1] &= 0xBB  # keep the fp16 scale finite (exponent < 31), keep its sign
    ours = Q.dequantize_q8_0(raw, (32, 256))
    assert ours.dtype == torch.float32 and ours.shape == (32, 256)
    assert bits_equal(ours.numpy(), gq.dequantize(raw, G.Q8_0))
    assert bits_equal(Q.dequantize(torch.from_numpy(raw), G.Q8_0, (32, 256)).numpy(), gq.dequantize(raw, G.Q8_0))
    # flat bytes, other shape of the same data
    assert bits_equal(Q.dequantize(raw.reshape(-1), 8, (4, 8, 256)).numpy(), ours.numpy().reshape(4, 8, 256))


def test_q8_0_round_trip_error_and_zero_block():
    x = torch.randn(64, 512, generator=gen(4))
    d = Q.dequantize_q8_0(Q.quantize_q8_0(x), x.shape)
    assert ((d - x).norm() / x.norm()).item() < 1e-2
    z = torch.zeros(2, 32)
    raw = Q.quantize_q8_0(z)
    assert np.array_equal(raw.numpy(), gq.quantize(z.numpy(), G.Q8_0)) and int(raw.sum()) == 0
    assert torch.equal(Q.dequantize_q8_0(raw, z.shape), z)


# ----------------------------------------------------------------------------------------------------------
# e2m1, MXFP4
# ----------------------------------------------------------------------------------------------------------


def test_e2m1_grid_and_ties():
    grid = torch.tensor(E2M1)
    assert torch.equal(Q.e2m1_round(grid), grid)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(Q.e2m1_round(ties), want)
    assert torch.equal(Q.e2m1_round(-ties), -want)
    v = np.arange(-6 * 256, 6 * 256 + 1, dtype=np.float32) / 256  # fine sweep incl. every tie
    assert np.array_equal(Q.e2m1_round(torch.from_numpy(v)).numpy(), ref_e2m1_rne(v))
    assert Q.e2m1_round(torch.tensor([0.26, 0.24, 5.01, 4.99])).tolist() == [0.5, 0.0, 6.0, 4.0]


def test_mxfp4_e8m0_scale():
    # code 2 = doubled 2 -> value 2 * 2^(e-128) = 2^(e-127)
    es = [0, 1, 2, 100, 126, 127, 128, 130, 200, 252]  # 6 * 2^(253-127) overflows fp32
    raw = np.zeros((len(es), 17), np.uint8)
    raw[:, 0] = es
    raw[:, 1] = 0x72  # element 0: code 2 (= 1.0 * scale), element 16: code 7 (= 6.0 * scale)
    out = Q.dequantize_mxfp4(raw, (len(es), 32)).numpy()
    for i, e in enumerate(es):
        assert out[i, 0] == np.float32(2.0 ** (e - 127)), e
        assert out[i, 16] == np.float32(6.0 * 2.0 ** (e - 127)), e
        assert not out[i, 1:16].any() and not out[i, 17:].any()
    assert out[es.index(127), 0] == 1.0 and out[es.index(128), 16] == 12.0


def test_mxfp4_nibble_order_hand_block():
    codes = np.array([(3 * j + 1) % 16 for j in range(32)], np.uint8)
    raw = np.zeros(17, np.uint8)
    raw[0] = 127  # 2^(127-128) * doubled = plain e2m1
    raw[1:] = codes[:16] | (codes[16:] << 4)
    out = Q.dequantize_mxfp4(raw, (32,)).numpy()
    assert np.array_equal(out, E2M1[codes])
    assert out[0] == 0.5 and out[1] == 2.0 and out[16] == 0.5 and out[17] == 2.0 and out[5] == 0.0 and out[4] == -3.0
    # quantizer: block with amax 6 -> s = 1 -> e = 127, codes as built (zero stored as code 0)
    x = torch.from_numpy(E2M1[codes].copy())
    x[x == 0] = 0.0
    ours = Q.quantize_mxfp4(x).numpy()
    want = raw.copy()
    c = codes.copy()
    c[c == 8] = 0  # -0.0 -> code 0
    want[1:] = c[:16] | (c[16:] << 4)
    assert np.array_equal(ours, want)


def test_mxfp4_quantize_known_scale():
    # amax = 1.0 -> amax/6 = 1/6 -> s = 2^-2 -> e = 125; 1.0/s = 4 (code 6); 0.3/s = 1.2 -> 1.0 (code 2)
    x = torch.zeros(32)
    x[0], x[1], x[17] = 1.0, 0.3, -0.8  # -0.8/s = -3.2 -> -3 (code 13)
    raw = Q.quantize_mxfp4(x).numpy()
    assert raw[0] == 125
    assert raw[1] == 6  # element 0 low nibble, element 16 (zero) high nibble
    assert raw[2] == (2 | (13 << 4))  # element 1 low, element 17 high
    d = Q.dequantize_mxfp4(raw, (32,))
    assert d[0] == 1.0 and d[1] == 0.25 and d[17] == -0.75


def test_mxfp4_dequantize_byte_identical_to_gguf():
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (64, 8 * 17), dtype=np.uint8)
    blocks = raw.reshape(-1, 17)
    blocks[:, 0] = rng.integers(2, 253, blocks.shape[0])  # e >= 2, and < 253 where 12 * 2^(e-128) overflows
    assert bits_equal(Q.dequantize_mxfp4(raw, (64, 256)).numpy(), gq.dequantize(raw, G.MXFP4))
    # every exponent byte, including ggml's subnormal half-scales for e = 0, 1 and the overflow at 255
    raw2 = rng.integers(0, 256, (256, 17), dtype=np.uint8)
    raw2[:, 0] = np.arange(256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = gq.dequantize(raw2, G.MXFP4)
    assert bits_equal(Q.dequantize(raw2, G.MXFP4, (256, 32)).numpy(), ref)


def test_mxfp4_fixed_point_and_error():
    x = rand_blocks(6, 32, 512)
    q1 = Q.quantize_mxfp4(x)
    assert q1.shape == (32, 512 // 32 * 17) and q1.dtype == torch.uint8
    v1 = Q.dequantize_mxfp4(q1, x.shape)
    q2 = Q.quantize_mxfp4(v1)
    v2 = Q.dequantize_mxfp4(q2, x.shape)
    assert torch.equal(v2, v1)  # values are a fixed point after one pass
    assert torch.equal(Q.quantize_mxfp4(v2), q2)  # bytes are a fixed point from the second pass on
    # when the block max survives rounding as 6 * s, the bytes are already a fixed point
    same_scale = q1.view(-1, 17)[:, 0] == q2.view(-1, 17)[:, 0]
    assert torch.equal(q1.view(-1, 17)[same_scale], q2.view(-1, 17)[same_scale]) and same_scale.any()
    y = torch.randn(64, 512, generator=gen(7))
    d = Q.dequantize(Q.quantize(y, G.MXFP4), G.MXFP4, y.shape)
    assert ((d - y).norm() / y.norm()).item() < 0.2


def test_mxfp4_quantize_matches_fp4_fake_quant_and_zero_block():
    x = rand_blocks(8, 8, 256, torch.bfloat16)
    assert torch.equal(Q.dequantize_mxfp4(Q.quantize_mxfp4(x), x.shape), Q.fp4_fake_quant(x).float())
    z = torch.zeros(3, 32)
    raw = Q.quantize_mxfp4(z)
    assert raw[:, 0].tolist() == [1, 1, 1] and int(raw[:, 1:].sum()) == 0  # s = 2^-126 floor
    assert torch.equal(Q.dequantize_mxfp4(raw, z.shape), z)
    assert torch.equal(Q.fp4_fake_quant(z.bfloat16()), z.bfloat16())
    assert torch.equal(Q.fp8_fake_quant(torch.zeros(2, 64, dtype=torch.bfloat16)), torch.zeros(2, 64, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------------------
# pow2 scale, fp8 / fp4 fake quant, act quant
# ----------------------------------------------------------------------------------------------------------


def test_pow2_ceil_scale_known():
    a = torch.tensor([448.0, 448.0001, 447.99, 224.0, 224.0001, 1.0, 1e-4, 896.0, 448.0 * 2**-40])
    assert Q.pow2_ceil_scale(a, 448.0).tolist() == [1.0, 2.0, 1.0, 0.5, 1.0, 2.0**-8, 2.0**-22, 2.0, 2.0**-40]
    b = torch.tensor([6.0, 6.000001, 3.0, 6 * 2.0**-126, 1.0, 6 * 2.0**100])
    assert Q.pow2_ceil_scale(b, 6.0).tolist() == [1.0, 2.0, 0.5, 2.0**-126, 0.25, 2.0**100]
    nxt = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))
    assert Q.pow2_ceil_scale(nxt, 448.0).item() == 2.0


def test_pow2_ceil_scale_edges():
    """Quotients at the ends of fp32: subnormals (2^ceil(log2 m) * 2^-149), the smallest normal, the largest
    finite (rounds up to inf), inf, and y <= 0 or NaN (2^-149), against exact float64 arithmetic."""
    tiny = 2.0 ** -149
    ys = [tiny, 2 * tiny, 3 * tiny, 5 * tiny, 1023 * tiny, 1024 * tiny, 2.0 ** -127, 1.5 * 2.0 ** -127,
          2.0 ** -126 - tiny, 2.0 ** -126, 2.0 ** -126 + 2 ** -149 * 2, 2.0 ** 127, 1.5 * 2.0 ** 127,
          float(torch.finfo(torch.float32).max)]
    y = torch.tensor(ys, dtype=torch.float32)
    want = [2.0 ** math.ceil(math.log2(v)) if math.frexp(v)[0] != 0.5 else v for v in y.double().tolist()]
    got = Q.pow2_ceil_scale(y, 1.0)
    assert got.double().tolist() == [w if w < 2.0 ** 128 else math.inf for w in want]
    odd = Q.pow2_ceil_scale(torch.tensor([0.0, -0.0, -3.0, float("-inf"), float("nan"), float("inf")]), 1.0)
    assert odd.tolist() == [tiny] * 5 + [math.inf]


@pytest.mark.parametrize("qmax", [448.0, 6.0])
def test_pow2_ceil_scale_is_exact(qmax):
    g = gen(9)
    base = qmax * torch.exp2(torch.randint(-100, 100, (2000,), generator=g).float())
    rnd = torch.exp2(torch.rand(4000, generator=g) * 200 - 100)
    amax = torch.cat([base, torch.nextafter(base, torch.tensor(0.0)), torch.nextafter(base, torch.tensor(1e38)), rnd])
    s = Q.pow2_ceil_scale(amax, qmax)
    m, _ = torch.frexp(s)
    assert bool((m == 0.5).all())  # powers of two
    a64, s64 = amax.double(), s.double()
    assert bool((s64 * qmax >= a64).all()) and bool((s64 * 0.5 * qmax < a64).all())  # smallest such power
    # equal to the reference kernel's bit trick on amax * fp32(1/qmax)
    y = amax * torch.tensor(1 / qmax, dtype=torch.float32)
    bits = y.view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).int()
    assert torch.equal(s, torch.exp2(k.float()))


def test_e4m3_cast_is_rne():
    x = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 448.0, -1.0625, 2.0**-10, 3 * 2.0**-10])
    assert x.to(torch.float8_e4m3fn).float().tolist() == [1.0, 1.25, 16.0, 20.0, 448.0, -1.0, 0.0, 2.0**-8]


def test_fp8_fake_quant_known_values():
    x = torch.zeros(2, 64)
    x[0, 0] = 448.0  # s = 1
    x[0, 1:6] = torch.tensor([1.0625, 1.1875, 17.0, 19.0, -19.0])
    x[1, 0] = 1.0  # s = 2^-8: x/s = 256 x
    x[1, 1] = 1.0 / 256 * 17  # -> 17/256 / 2^-8 = 17 -> 16
    y = Q.fp8_fake_quant(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert y[0, :6].float().tolist() == [448.0, 1.0, 1.25, 16.0, 20.0, -20.0]
    assert y[1, 0].item() == 1.0 and y[1, 1].item() == 16 / 256
    q, s = Q.act_quant_fp8(x.bfloat16(), block=64)
    assert s.tolist() == [[1.0], [2.0**-8]]
    assert q[1, 1].item() == 16.0


def test_fp4_fake_quant_known_values_and_ties():
    x = torch.zeros(64)
    x[0] = 6.0  # s = 1
    x[1:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[8:15] = -x[1:8]
    x[32] = 3.0  # amax 3 -> s = 0.5: x/s = 6
    x[33] = 0.625  # 1.25 -> 1.0 -> 0.5
    y = Q.fp4_fake_quant(x.bfloat16()).float()
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert y[0].item() == 6.0 and y[1:8].tolist() == want and y[8:15].tolist() == [-w for w in want]
    assert y[32].item() == 3.0 and y[33].item() == 0.5


def _block_scale(x: torch.Tensor, block: int, floor: float, qmax: float) -> torch.Tensor:
    amax = x.float().reshape(-1, block).abs().amax(-1, keepdim=True).clamp(min=floor)
    return Q.pow2_ceil_scale(amax, qmax)


def test_fp8_fake_quant_properties():
    x = rand_blocks(10, 16, 448, torch.bfloat16)
    y = Q.fp8_fake_quant(x)
    assert torch.equal(Q.fp8_fake_quant(y), y)  # idempotent
    s = _block_scale(x, 64, 1e-4, 448.0)
    r = y.float().reshape(-1, 64) / s
    assert bool((r.abs() <= 448).all())
    assert torch.equal(r.to(torch.float8_e4m3fn).float(), r)  # on the e4m3 grid
    assert torch.equal(y.float(), (Q.act_quant_fp8(x, 64)[0].reshape(-1, 64) * s).reshape(y.shape))
    err = ((y.float() - x.float()).norm() / x.float().norm()).item()
    assert err < 0.05


def test_fp4_fake_quant_properties():
    x = rand_blocks(11, 16, 256, torch.bfloat16)
    y = Q.fp4_fake_quant(x)
    assert y.dtype == torch.bfloat16 and torch.equal(Q.fp4_fake_quant(y), y)
    s = _block_scale(x, 32, 6 * 2.0**-126, 6.0)
    r = y.float().reshape(-1, 32) / s
    assert torch.equal(Q.e2m1_round(r), r) and bool((r.abs() <= 6).all())  # on the e2m1 grid
    # definition, element by element against a brute-force RNE
    want = torch.from_numpy(ref_e2m1_rne((x.float().reshape(-1, 32) / s).clamp(-6, 6).numpy())) * s
    assert torch.equal(y.float(), want.reshape(y.shape))


def test_act_quant_fp8():
    x = rand_blocks(12, 6, 512, torch.bfloat16).view(2, 3, 512)
    q, s = Q.act_quant_fp8(x)
    assert q.dtype == torch.float32 and q.shape == (2, 3, 512)
    assert s.dtype == torch.float32 and s.shape == (2, 3, 4)
    assert bool((torch.frexp(s)[0] == 0.5).all())
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), q) and bool((q.abs() <= 448).all())
    deq = Q.act_quant_dequant(x)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    assert torch.equal(deq, (q.view(2, 3, 4, 128) * s.unsqueeze(-1)).view(2, 3, 512))
    assert torch.equal(deq, Q.fp8_fake_quant(x, block=128).float())  # e4m3 * 2^k is exact in bf16
    amax = x.float().view(2, 3, 4, 128).abs().amax(-1)
    assert bool((s * 448 >= amax).all()) and bool((s * 224 < amax.clamp(min=1e-4)).all())


# ----------------------------------------------------------------------------------------------------------
# DeepSeek FP4 <-> MXFP4
# ----------------------------------------------------------------------------------------------------------


def _deepseek_fp4_values(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    lo, hi = packed & 0x0F, packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)  # even index low
    vals = E2M1[codes].astype(np.float64)
    sc = np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=-1)
    return (vals * sc).astype(np.float32)


def test_deepseek_fp4_repack():
    rng = np.random.default_rng(13)
    n, k = 24, 256
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.integers(100, 150, (n, k // 32), dtype=np.uint8)
    raw = Q.deepseek_fp4_to_mxfp4(packed, scale)
    assert raw.dtype == torch.uint8 and raw.shape == (n, k // 32 * 17)
    assert np.array_equal(raw.view(-1, 17)[:, 0].numpy(), scale.reshape(-1))  # same exponent byte
    assert np.array_equal(Q.dequantize_mxfp4(raw, (n, k)).numpy(), _deepseek_fp4_values(packed, scale))
    p2, s2 = Q.mxfp4_to_deepseek_fp4(raw, (n, k))
    assert p2.shape == (n, k // 2) and s2.shape == (n, k // 32)
    assert np.array_equal(p2.numpy(), packed) and np.array_equal(s2.numpy(), scale)
    # int8 codes and a float8_e8m0fnu scale (the checkpoint's dtypes) are reinterpreted, not converted
    raw_i8 = Q.deepseek_fp4_to_mxfp4(torch.from_numpy(packed.view(np.int8)), torch.from_numpy(scale).view(torch.float8_e8m0fnu))
    assert torch.equal(raw_i8, raw)
    # GGUF -> DeepSeek -> GGUF on a quantized tensor
    w = Q.quantize_mxfp4(rand_blocks(14, 8, 128))
    assert torch.equal(Q.deepseek_fp4_to_mxfp4(*Q.mxfp4_to_deepseek_fp4(w, (8, 128))), w)


def test_deepseek_fp4_hand_block():
    # element 0 = code 1 (0.5), element 1 = code 7 (6), element 16 = code 9 (-0.5), element 17 = code 2 (1)
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0x71
    packed[0, 8] = 0x29
    raw = Q.deepseek_fp4_to_mxfp4(packed, np.array([[127]], np.uint8)).numpy()[0]
    assert raw[0] == 127
    assert raw[1] == (1 | (9 << 4)) and raw[2] == (7 | (2 << 4)) and not raw[3:].any()
    d = Q.dequantize_mxfp4(raw, (32,))
    assert d[0] == 0.5 and d[1] == 6.0 and d[16] == -0.5 and d[17] == 1.0


def test_deepseek_fp4_repack_bad_shapes():
    with pytest.raises(QuantError, match=r"needs scale of shape \(4, 2\), found \(4, 3\)"):
        Q.deepseek_fp4_to_mxfp4(np.zeros((4, 32), np.uint8), np.zeros((4, 3), np.uint8))
    with pytest.raises(QuantError, match=r"multiple of the block size 32, found 40"):
        Q.deepseek_fp4_to_mxfp4(np.zeros((4, 20), np.uint8), np.zeros((4, 1), np.uint8))
    with pytest.raises(QuantError, match=r"uint8/int8"):
        Q.deepseek_fp4_to_mxfp4(np.zeros((4, 16), np.float32), np.zeros((4, 1), np.uint8))


# ----------------------------------------------------------------------------------------------------------
# dispatchers for plain types
# ----------------------------------------------------------------------------------------------------------


def test_plain_types_dispatch():
    x = torch.randn(4, 48, generator=gen(15))
    # F32
    assert torch.equal(Q.dequantize(Q.quantize(x, G.F32), G.F32, (4, 48)), x)
    assert torch.equal(Q.dequantize(x.numpy().view(np.uint8), 0, (4, 48)), x)
    # F16
    h = Q.quantize(x, G.F16)
    assert h.dtype == torch.float16 and np.array_equal(h.numpy(), gq.quantize(x.numpy(), G.F16))
    assert bits_equal(Q.dequantize(h.numpy(), G.F16, (4, 48)).numpy(), gq.dequantize(h.numpy().view(np.uint8), G.F16).reshape(4, 48))
    # BF16: torch tensor, numpy uint16/int16 bits, raw bytes; RNE identical to gguf's BF16 quantizer
    b = Q.quantize(x, G.BF16)
    assert b.dtype == torch.bfloat16
    ref_bytes = gq.quantize(x.numpy(), G.BF16)
    assert np.array_equal(b.view(torch.uint8).numpy().reshape(ref_bytes.shape), ref_bytes)
    bits16 = ref_bytes.reshape(-1).view(np.uint16)
    for raw in (b, bits16, bits16.view(np.int16), ref_bytes):
        out = Q.dequantize(raw, G.BF16, (4, 48))
        assert out.dtype == torch.float32 and bits_equal(out.numpy(), gq.dequantize(ref_bytes, G.BF16).reshape(4, 48))
    assert torch.equal(Q.dequantize(bits16, G.BF16, (4, 48), dtype=torch.bfloat16), b)
    # I32
    ids = torch.randint(0, 256, (10, 6), generator=gen(16), dtype=torch.int64)
    i32 = Q.quantize(ids, G.I32)
    assert i32.dtype == torch.int32
    assert torch.equal(Q.dequantize(i32.numpy(), G.I32, (10, 6), dtype=torch.int32), i32)
    # block types through the dispatcher with dtype
    y = Q.dequantize(Q.quantize(x[:, :32], G.Q8_0), G.Q8_0, (4, 32), dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 32)


def test_read_only_numpy_input_is_not_copied_or_written():
    rng = np.random.default_rng(17)
    raw = rng.integers(0, 256, (4, 17 * 2), dtype=np.uint8)
    raw.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = Q.dequantize(raw, G.MXFP4, (4, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert bits_equal(out.numpy(), gq.dequantize(raw, G.MXFP4))


def test_misaligned_byte_slice():
    x = torch.randn(8, generator=gen(18))
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), x.view(torch.uint8)])
    assert torch.equal(Q.dequantize(buf[3:], G.F32, (8,)), x)
