"""Quantization formats of ds4c: GGUF storage types and the DeepSeek fake/real quantizers.

Two families live here, both vectorized in torch (CPU or any device; no Python loop over blocks --
large tensors are processed in chunks of ~16M elements only to bound temporary memory):

* **GGUF storage formats** (docs/gguf-layout.md, "Tensor types ds4c reads"):
  F32, F16, BF16, I32 (plain) and the block formats

  - ``Q8_0``: blocks of 32 values in 34 bytes: fp16 scale ``d`` (little-endian) then 32 int8 ``q``;
    value = ``d * q``. The quantizer is byte-identical to ``gguf.quants.quantize(.., Q8_0)``:
    ``d = amax / 127`` (fp32), ``id = 1 / d`` computed from the fp32 ``d`` *before* ``d`` is cast to fp16,
    ``q = round_half_away_from_zero(x * id)``.
  - ``MXFP4``: blocks of 32 values in 17 bytes: one e8m0 exponent byte ``e`` then 16 bytes; byte ``j`` holds
    element ``j`` in its low nibble and element ``j + 16`` in its high nibble; nibble -> doubled e2m1 table
    ``0,1,2,3,4,6,8,12`` (codes 8..15 the same negated); value = ``table[nibble] * 2^(e-128)``, i.e.
    ``e2m1[nibble] * 2^(e-127)``. Dequantization is bit-identical to ``gguf.quants.dequantize`` for every
    byte pattern (including ``e < 2``, which ggml decodes to the subnormals ``2^-128``, ``2^-127``).
    The quantizer uses the DeepSeek scale rule (docs/model.md P4), not gguf's ``floor(log2 amax) - 2``.
  - **K-quants and IQ4_XS** (llama.cpp's ``block_q*_K`` / ``block_iq4_xs``; read only, see :func:`quantize`):
    super-blocks of ``QK_K = 256`` values along the row, so a row must be a multiple of 256 values
    (:data:`SUPER_BLOCKS`, :func:`super_block`). ``fp16`` fields are little-endian and converted exactly to
    fp32; every product below is one fp32 operation, evaluated in the order written (the order of
    ``gguf.quants``, so dequantization is bit-identical to it). The products are exact (at most 23
    significant bits: docs/gguf-layout.md), so only the final ``- dmin * m`` of Q2_K / Q4_K / Q5_K rounds.
    Value index ``i`` in 0..255; ``l`` is the position inside the 32 (or 16 / 64) bytes a group of values shares.

    - ``Q2_K`` (84 bytes): ``scales[16]`` @0 (byte ``j``: low nibble = scale, high nibble = min of the
      16-value sub-block ``j = i/16``), ``qs[64]`` @16, fp16 ``d`` @80, fp16 ``dmin`` @82. 2-bit code:
      ``h = i/128, s = (i%128)/32, l = i%32``: ``q = (qs[32h+l] >> 2s) & 3``.
      value = ``(d * (scales[j] & 15)) * q - dmin * (scales[j] >> 4)``.
    - ``Q3_K`` (110 bytes): ``hmask[32]`` @0, ``qs[64]`` @32, ``scales[12]`` @96, fp16 ``d`` @108.
      16 6-bit signed scales, sub-block ``j = i/16``: low 4 bits ``scales[j] & 15`` (j < 8) or
      ``scales[j-8] >> 4`` (j >= 8), high 2 bits ``(scales[8 + j%4] >> 2(j/4)) & 3``; ``sc = bits - 32``.
      ``q = ((qs[32h+l] >> 2s) & 3) - 4 * (1 - ((hmask[i%32] >> (i/32)) & 1))`` (h, s, l as Q2_K: a set hmask
      bit means no offset). value = ``(d * sc[j]) * q``.
    - ``Q4_K`` (144 bytes): fp16 ``d`` @0, fp16 ``dmin`` @2, ``scales[12]`` @4, ``qs[128]`` @16. 8 sub-blocks
      of 32, ``j = i/32``, 6-bit scale and min: for j < 4 ``sc = scales[j] & 63``, ``m = scales[j+4] & 63``;
      for j >= 4 ``sc = (scales[j+4] & 15) | ((scales[j-4] >> 6) << 4)``,
      ``m = (scales[j+4] >> 4) | ((scales[j] >> 6) << 4)``. ``q = (qs[32(j/2) + i%32] >> 4(j%2)) & 15``.
      value = ``(d * sc) * q - dmin * m``.
    - ``Q5_K`` (176 bytes): ``d`` @0, ``dmin`` @2, ``scales[12]`` @4 (as Q4_K), ``qh[32]`` @16, ``qs[128]`` @48.
      ``q = Q4_K's 4 bits | ((qh[i%32] >> j) & 1) << 4``; value = ``(d * sc) * q - dmin * m``.
    - ``Q6_K`` (210 bytes): ``ql[128]`` @0, ``qh[64]`` @128, int8 ``scales[16]`` @192 (one per 16 values),
      fp16 ``d`` @208. ``h = i/128, k = i%128``: low 4 bits ``(ql[64h + k%64] >> 4(k/64)) & 15``, high 2 bits
      ``(qh[32h + k%32] >> 2(k/32)) & 3``; ``q = bits - 32``. value = ``(d * scales[i/16]) * q``.
    - ``IQ4_XS`` (136 bytes): fp16 ``d`` @0, uint16 ``scales_h`` @2, ``scales_l[4]`` @4, ``qs[128]`` @8.
      sub-block ``j = i/32``: ``sc = ((scales_l[j/2] >> 4(j%2)) & 15 | ((scales_h >> 2j) & 3) << 4) - 32``;
      code ``c = (qs[16j + (i%32)%16] >> 4((i%32)/16)) & 15`` into the non-linear table
      ``-127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113``. value = ``(d * sc) * table[c]``.

* **DeepSeek numeric primitives** (docs/model.md section 2.3 step 1, section 3 P3 and P4):
  ``pow2_ceil_scale`` (UE8M0 power-of-two scale), ``e2m1_round``, ``fp4_fake_quant`` (P4, block 32),
  ``fp8_fake_quant`` (P3, block 64) and ``act_quant_fp8`` / ``act_quant_dequant`` (2.3 step 1, block 128).

and the exact repack between the official DeepSeek FP4 expert layout (docs/model.md 2.1: two codes per
byte, *even* index in the low nibble, ``F8_E8M0`` scale ``2^(e-127)`` per 32 K-elements over the plain e2m1
table) and GGUF MXFP4 (same codes, same exponent byte, different nibble order).

Shapes follow torch order: the last dim is the row length (GGUF ``ne[0]``) and blocks run along it.
All errors on bad input are :class:`ds4c.errors.QuantError`.
"""

from __future__ import annotations

import enum
import warnings
from typing import Callable, NamedTuple, Sequence, Union

import numpy as np
import torch

from ds4c.errors import QuantError

try:  # re-export gguf's enum so values compare equal with everything gguf returns
    from gguf import GGMLQuantizationType as GGMLType
except ImportError:  # pragma: no cover - gguf is a dependency, this is only a fallback

    class GGMLType(enum.IntEnum):  # type: ignore[no-redef]
        """ggml tensor type ids used by ds4c (subset of ``gguf.GGMLQuantizationType``)."""

        F32 = 0
        F16 = 1
        Q8_0 = 8
        Q2_K = 10
        Q3_K = 11
        Q4_K = 12
        Q5_K = 13
        Q6_K = 14
        IQ4_XS = 23
        I32 = 26
        BF16 = 30
        MXFP4 = 39


__all__ = [
    "GGMLType",
    "BLOCK",
    "SUPPORTED_TYPES",
    "nbytes",
    "quantize_q8_0",
    "dequantize_q8_0",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "QK_K",
    "SuperBlock",
    "SUPER_BLOCKS",
    "SUPER_BLOCK_NAMES",
    "super_block",
    "is_super_block",
    "dequantize_super_block",
    "e2m1_round",
    "pow2_ceil_scale",
    "fp4_fake_quant",
    "fp8_fake_quant",
    "act_quant_fp8",
    "act_quant_dequant",
    "dequantize",
    "quantize",
    "deepseek_fp4_to_mxfp4",
    "mxfp4_to_deepseek_fp4",
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
]

ArrayLike = Union[torch.Tensor, np.ndarray]

#: (values per block, bytes per block) of the block formats (the K-quants' and IQ4_XS's blocks are their
#: super-blocks of 256 values; see :data:`SUPER_BLOCKS`).
BLOCK: dict = {GGMLType.Q8_0: (32, 34), GGMLType.MXFP4: (32, 17),
               GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144),
               GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.IQ4_XS: (256, 136)}

#: bytes per element of the plain formats.
_PLAIN_SIZE = {GGMLType.F32: 4, GGMLType.F16: 2, GGMLType.BF16: 2, GGMLType.I32: 4}

#: every ggml type this module reads and writes.
SUPPORTED_TYPES = tuple(_PLAIN_SIZE) + tuple(BLOCK)

#: plain e2m1 magnitudes for codes 0..7 (code 8..15 = the same negated).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: the doubled table GGUF MXFP4 uses (``gguf.quants.MXFP4.kvalues``).
_MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
_FP8_AMAX_FLOOR = 1e-4  # spec 2.3 step 1 and P3 (an fp32 constant in the reference kernel)
_FP4_AMAX_FLOOR = 6.0 * 2.0**-126  # spec P4

# Elements per chunk for the block kernels: bounds temporaries (~a few x 64 MiB) on 100M-element tensors.
_CHUNK_ELEMS = 1 << 24


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------


def _ggml_type(ggml_type) -> GGMLType:
    """Normalize an int / enum / name to :class:`GGMLType`; raise QuantError naming anything unsupported."""
    t = ggml_type
    try:
        if isinstance(t, str):
            t = GGMLType[t.upper()]
        else:
            t = GGMLType(int(t))
    except (KeyError, ValueError, TypeError):
        raise QuantError(
            f"unknown ggml type {ggml_type!r}; expected one of "
            + ", ".join(f"{s.name} ({int(s)})" for s in SUPPORTED_TYPES)
        ) from None
    if t not in SUPPORTED_TYPES:
        raise QuantError(
            f"ggml type {t.name} ({int(t)}) is not supported by ds4c; expected one of "
            + ", ".join(f"{s.name} ({int(s)})" for s in SUPPORTED_TYPES)
        )
    return t


def _shape(shape) -> tuple:
    try:
        out = tuple(int(d) for d in shape)
    except TypeError:
        raise QuantError(f"expected a shape (sequence of ints), found {shape!r}") from None
    if any(d < 0 for d in out):
        raise QuantError(f"expected non-negative dims, found shape {out}")
    return out


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_block_dim(k: int, block: int, what: str) -> None:
    if block <= 0 or k % block != 0:
        raise QuantError(f"{what}: the last dim must be a multiple of the block size {block}, found {k}")


def nbytes(ggml_type, shape: Sequence[int]) -> int:
    """Bytes a tensor of torch-order ``shape`` (last dim = row length) occupies in ``ggml_type``.

    Block formats (:data:`BLOCK`: Q8_0 32 values / 34 bytes, MXFP4 32 / 17, the K-quants and IQ4_XS 256 values
    per super-block) need the last dim to be a multiple of their block; otherwise :class:`QuantError`.
    docs/gguf-layout.md "Tensor types ds4c reads" and "K-quants and IQ4_XS".
    """
    t = _ggml_type(ggml_type)
    shp = _shape(shape)
    if t in BLOCK:
        bs, ts = BLOCK[t]
        if len(shp) == 0:
            raise QuantError(f"{t.name}: expected a shape with a row dimension, found a scalar shape ()")
        if shp[-1] % bs:
            hint = (" (rows of a K-quant / IQ4_XS tensor are whole super-blocks of 256 values; ds4c stores "
                    "such tensors as Q8_0: ds4c.tensors.storage_types)" if t in SUPER_BLOCKS else "")
            raise QuantError(f"{t.name} tensor of shape {shp}: the last dim must be a multiple of the block "
                             f"size {bs}, found {shp[-1]}{hint}")
        return _numel(shp) // bs * ts
    return _numel(shp) * _PLAIN_SIZE[t]


def _to_tensor(x: ArrayLike) -> torch.Tensor:
    """torch view of a tensor / numpy array (zero-copy where possible; read-only memmaps are not written)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if x.dtype.byteorder == ">":
            raise QuantError(f"expected a little-endian array, found dtype {x.dtype}")
        if x.dtype.kind not in "biuf":
            raise QuantError(f"expected a numeric numpy array, found dtype {x.dtype}")
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        with warnings.catch_warnings():  # read-only memmaps: we never write through this view
            warnings.simplefilter("ignore", UserWarning)
            try:
                return torch.from_numpy(x)
            except TypeError:
                raise QuantError(f"expected a numpy dtype torch can view, found {x.dtype}") from None
    if isinstance(x, (bytes, bytearray, memoryview)):
        return torch.frombuffer(bytearray(x), dtype=torch.uint8)
    raise QuantError(f"expected a torch.Tensor or numpy.ndarray, found {type(x).__name__}")


def _as_bytes(raw: ArrayLike) -> torch.Tensor:
    """Flat uint8 view of ``raw``'s bytes (int8, uint16, bf16, fp8, ... are reinterpreted, not converted)."""
    t = _to_tensor(raw)
    if t.dtype == torch.bool:
        raise QuantError("expected raw bytes (uint8 or another fixed-size dtype), found a bool tensor")
    t = t.contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t


def _raw_blocks(raw: ArrayLike, ggml_type: GGMLType, shape) -> tuple:
    shp = _shape(shape)
    need = nbytes(ggml_type, shp)
    b = _as_bytes(raw)
    if b.numel() != need:
        raise QuantError(
            f"{ggml_type.name} data for shape {shp}: expected {need} bytes, found {b.numel()} "
            f"(raw of shape {tuple(_to_tensor(raw).shape)}, dtype {_to_tensor(raw).dtype})"
        )
    _, ts = BLOCK[ggml_type]
    return b.view(-1, ts), shp


def _float_input(x: ArrayLike, what: str) -> torch.Tensor:
    t = _to_tensor(x)
    if not t.is_floating_point():
        raise QuantError(f"{what}: expected a floating-point tensor, found dtype {t.dtype}")
    return t


def _map_blocks(fn: Callable[[torch.Tensor], torch.Tensor], blocks: torch.Tensor, out_cols: int,
                out_dtype: torch.dtype, block_elems: int) -> torch.Tensor:
    """Apply ``fn`` ([n, in_cols] -> [n, out_cols]) over row chunks of ``blocks`` (bounds temporaries)."""
    nb = blocks.shape[0]
    chunk = max(1, _CHUNK_ELEMS // block_elems)
    if nb <= chunk:
        return fn(blocks)
    out = torch.empty((nb, out_cols), dtype=out_dtype, device=blocks.device)
    for i in range(0, nb, chunk):
        out[i:i + chunk] = fn(blocks[i:i + chunk])
    return out


_MANTISSA_MASK = (1 << 23) - 1  # fp32 mantissa bits
_FP32_MIN_NORMAL = 2.0 ** -126


# ---------------------------------------------------------------------------------------------------------
# scale and e2m1 primitives (spec 2.3, P3, P4)
# ---------------------------------------------------------------------------------------------------------


def pow2_ceil_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """UE8M0 scale ``s = 2^ceil(log2(amax / qmax))`` (spec 2.3 step 1, P3, P4), exact.

    ``amax``: any shape, converted to float32; ``y = amax / qmax`` is an fp32 division and ``ceil(log2 y)``
    is taken from the exponent of ``y`` (``torch.frexp``: ``y = m * 2^e``, ``m`` in [0.5, 1); the ceil is
    ``e - 1`` when ``m == 0.5`` else ``e``), never from a rounded float log2. Returns float32 of the same
    shape holding exact powers of two (``amax = 448, qmax = 448 -> 1``; ``448.0001 -> 2``).

    For qmax = 448 and 6 this equals the reference kernel's ``amax * fp32(1/qmax)`` bit trick and the
    mathematically smallest power of two ``s`` with ``s * qmax >= amax`` for every normal fp32 ``amax``.
    ``amax`` must be positive and finite (callers floor it); ``amax <= 0`` gives ``2^-149``, ``inf`` gives inf.
    """
    a = amax.to(torch.float32) if isinstance(amax, torch.Tensor) else torch.as_tensor(amax, dtype=torch.float32)
    y = a / qmax
    # the power of two at or above a positive normal y (or inf) from its bits: adding a full mantissa carries into
    # the exponent unless the mantissa is 0 (y a power of two), and the mask drops the mantissa; 2^127 < y rounds
    # up to the exponent 255, inf. A subnormal y = m * 2^-149 (integer m < 2^23) has scale 2^ceil(log2 m) * 2^-149,
    # whose bits are the integer 2^ceil(log2 m): the same carry on m's exact fp32 value. y <= 0 (and NaN): 2^-149.
    # About a third of the ops of frexp + where + bits (the CPU reference calls this ~2,500 times a token).
    normal = (y.view(torch.int32) + _MANTISSA_MASK) & ~_MANTISSA_MASK
    # the common case (callers floor amax): three ops, not eleven; eager only (a traced graph cannot branch on data)
    if not torch.compiler.is_compiling() and bool((y >= _FP32_MIN_NORMAL).all()):
        return normal.view(torch.float32)
    m = y.view(torch.int32).to(torch.float32)
    sub = ((m.view(torch.int32) + _MANTISSA_MASK) & ~_MANTISSA_MASK).view(torch.float32).to(torch.int32)
    bits = torch.where(y >= _FP32_MIN_NORMAL, normal, torch.where(y > 0, sub, torch.ones_like(normal)))
    return bits.view(torch.float32)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (0..15, sign = bit 3, zero always code 0) of float32 ``y``, RNE, saturating at 6."""
    a = y.abs().clamp_(max=FP4_E2M1_MAX)
    # [0,2): step 0.5 -> code = 2a ; [2,4): step 1 -> code = a + 2 ; [4,6]: step 2 -> code = a/2 + 4.
    # torch.round is round-half-to-even on the integer, which is RNE on the e2m1 mantissa bit.
    c = torch.where(a < 2, torch.round(a * 2), torch.where(a < 4, torch.round(a) + 2, torch.round(a * 0.5) + 4))
    c = c.to(torch.uint8)
    neg = (y < 0) & (c != 0)
    return c | (neg.to(torch.uint8) << 3)


def _e2m1_table(device, doubled: bool = False) -> torch.Tensor:
    vals = _MXFP4_KVALUES if doubled else tuple(v * 0.5 for v in _MXFP4_KVALUES)
    return torch.tensor(vals, dtype=torch.float32, device=device)


def _codes_to_values(codes: torch.Tensor, doubled: bool) -> torch.Tensor:
    table = _e2m1_table(codes.device, doubled)
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the FP4 e2m1 grid {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}, round-to-nearest-even (spec P4).

    Ties go to the even mantissa: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. Input is meant to
    be already clamped to [-6, 6] (values beyond saturate to ±6). Returns float32 of ``x``'s shape; zero and
    values rounding to zero come back as +0.0.
    """
    t = _float_input(x, "e2m1_round").to(torch.float32)
    return _codes_to_values(_e2m1_codes(t), doubled=False)


def fp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 fake-quant, docs/model.md P4: per block of ``block`` (32) along the last dim,
    ``amax = max(max|x|, 6*2^-126)``, ``s = 2^ceil(log2(amax/6))`` (exact), ``x <- bf16(e2m1(clamp(x/s, ±6)) * s)``.

    ``x``: bf16 ``[..., K]`` with ``K % block == 0`` (other float dtypes are accepted and their values used
    as fp32). Returns bf16 ``[..., K]``; every output is an e2m1 value times a power of two (exact in bf16).
    """
    t = _float_input(x, "fp4_fake_quant")
    if t.dim() == 0:
        raise QuantError("fp4_fake_quant: expected a tensor with a last dim, found a scalar")
    _check_block_dim(t.shape[-1], block, f"fp4_fake_quant of shape {tuple(t.shape)}")
    xb = t.to(torch.float32).reshape(-1, block)

    def fn(b: torch.Tensor) -> torch.Tensor:
        amax = b.abs().amax(dim=-1, keepdim=True).clamp_(min=_FP4_AMAX_FLOOR)
        s = pow2_ceil_scale(amax, FP4_E2M1_MAX)
        q = e2m1_round((b / s).clamp_(-FP4_E2M1_MAX, FP4_E2M1_MAX))
        return (q * s).to(torch.bfloat16)

    return _map_blocks(fn, xb, block, torch.bfloat16, block).view(t.shape)


def _fp8_quant_blocks(b: torch.Tensor) -> tuple:
    """fp32 blocks [n, B] -> (q fp32 e4m3 values [n, B], s fp32 [n, 1]); spec 2.3 step 1 / P3."""
    amax = b.abs().amax(dim=-1, keepdim=True).clamp_(min=_FP8_AMAX_FLOOR)
    s = pow2_ceil_scale(amax, FP8_E4M3_MAX)
    q = (b / s).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return q, s


def fp8_fake_quant(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """FP8 fake-quant ("act_quant inplace"), docs/model.md P3: per block of ``block`` (64) along the last
    dim, ``amax = max(max|x|, 1e-4)``, ``s = 2^ceil(log2(amax/448))`` (exact), ``x <- bf16(fp32(e4m3(clamp(x/s,
    ±448))) * s)`` with e4m3 (``torch.float8_e4m3fn``) round-to-nearest-even.

    ``x``: bf16 ``[..., K]``, ``K % block == 0`` (the caller applies it to the first 448 dims of each KV row).
    Returns bf16 ``[..., K]``.
    """
    t = _float_input(x, "fp8_fake_quant")
    if t.dim() == 0:
        raise QuantError("fp8_fake_quant: expected a tensor with a last dim, found a scalar")
    _check_block_dim(t.shape[-1], block, f"fp8_fake_quant of shape {tuple(t.shape)}")
    xb = t.to(torch.float32).reshape(-1, block)

    def fn(b: torch.Tensor) -> torch.Tensor:
        q, s = _fp8_quant_blocks(b)
        return (q * s).to(torch.bfloat16)

    return _map_blocks(fn, xb, block, torch.bfloat16, block).view(t.shape)


def act_quant_fp8(x: torch.Tensor, block: int = 128) -> tuple:
    """Activation quantization of the quantized linear, docs/model.md 2.3 step 1.

    ``x``: bf16 ``[..., K]`` with ``K % block == 0`` (block 128). Per block: ``amax = max(max|x|, 1e-4)``,
    ``s = 2^ceil(log2(amax/448))`` (exact UE8M0), ``q = e4m3(clamp(x/s, ±448))`` (RNE).
    Returns ``(q, s)``: ``q`` float32 ``[..., K]`` holding the e4m3 values, ``s`` float32 ``[..., K/block]``.
    """
    t = _float_input(x, "act_quant_fp8")
    if t.dim() == 0:
        raise QuantError("act_quant_fp8: expected a tensor with a last dim, found a scalar")
    _check_block_dim(t.shape[-1], block, f"act_quant_fp8 of shape {tuple(t.shape)}")
    xb = t.to(torch.float32).reshape(-1, block)
    q, s = _fp8_quant_blocks(xb)
    return q.view(t.shape), s.view(*t.shape[:-1], t.shape[-1] // block)


def act_quant_dequant(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``q * s`` of :func:`act_quant_fp8` broadcast back to float32 ``[..., K]``: the exact fp32 activation the
    quantized GEMM multiplies (spec 2.3 steps 1-4)."""
    q, s = act_quant_fp8(x, block)
    k = q.shape[-1]
    return (q.view(-1, k // block, block) * s.reshape(-1, k // block, 1)).view(q.shape)


# ---------------------------------------------------------------------------------------------------------
# Q8_0
# ---------------------------------------------------------------------------------------------------------


def _q8_0_quant_blocks(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)  # from the fp32 d, as gguf/ggml do
    n = b * inv
    a = n.abs()
    fl = torch.floor(a)
    q = torch.sign(n) * (fl + torch.floor(2 * (a - fl)))  # round half away from zero (gguf np_roundf)
    d16 = d.to(torch.float16).view(torch.uint8)  # [n, 2], little-endian
    return torch.cat([d16, q.to(torch.int8).view(torch.uint8)], dim=-1)


def quantize_q8_0(x: ArrayLike) -> torch.Tensor:
    """Quantize to GGUF Q8_0 (docs/gguf-layout.md), byte-identical to ``gguf.quants.quantize(.., Q8_0)``.

    ``x``: float ``[..., K]`` (used as float32), ``K % 32 == 0``. Per block of 32: ``d = amax/127`` (fp32),
    ``q = round_half_away(x * (1/d))`` (``1/d`` from the fp32 ``d``; 0 when ``d == 0``), stored as fp16 ``d``
    then 32 int8. Returns uint8 ``[..., K/32*34]``.
    """
    return _quantize_blocks(x, "Q8_0", _q8_0_quant_blocks, 34)


def _quantize_blocks(x: ArrayLike, fmt: str, fn: Callable[[torch.Tensor], torch.Tensor], block_bytes: int) -> torch.Tensor:
    """Shared driver of the block quantizers: float ``[..., K]`` -> uint8 ``[..., K/32*block_bytes]``."""
    name = f"quantize_{fmt.lower()}"
    t = _float_input(x, name)
    if t.dim() == 0:
        raise QuantError(f"{name}: expected a tensor with a last dim, found a scalar")
    _check_block_dim(t.shape[-1], 32, f"{fmt} tensor of shape {tuple(t.shape)}")
    out = _map_blocks(fn, t.to(torch.float32).reshape(-1, 32), block_bytes, torch.uint8, 32)
    return out.view(*t.shape[:-1], t.shape[-1] // 32 * block_bytes)


def _q8_0_dequant_blocks(b: torch.Tensor) -> torch.Tensor:
    d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)
    q = b[:, 2:].view(torch.int8).to(torch.float32)
    return q * d


def dequantize_q8_0(raw: ArrayLike, shape: Sequence[int]) -> torch.Tensor:
    """Dequantize GGUF Q8_0 bytes (any dtype/shape holding exactly ``nbytes(Q8_0, shape)`` bytes) to float32
    of ``shape``: value = fp32(fp16 d) * int8 q, bit-identical to ``gguf.quants.dequantize``."""
    blocks, shp = _raw_blocks(raw, GGMLType.Q8_0, shape)
    return _map_blocks(_q8_0_dequant_blocks, blocks, 32, torch.float32, 32).view(shp)


# ---------------------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------------------


def _pack_mxfp4(codes: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """codes uint8 [n, 32], e uint8 [n, 1] -> GGUF MXFP4 blocks uint8 [n, 17] (j low nibble, j+16 high)."""
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return torch.cat([e, qs], dim=-1)


def _unpack_mxfp4_codes(b: torch.Tensor) -> torch.Tensor:
    """GGUF MXFP4 blocks uint8 [n, 17] -> codes uint8 [n, 32]."""
    qs = b[:, 1:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _mxfp4_quant_blocks(b: torch.Tensor) -> torch.Tensor:
    amax = b.abs().amax(dim=-1, keepdim=True).clamp_(min=_FP4_AMAX_FLOOR)
    s = pow2_ceil_scale(amax, FP4_E2M1_MAX)  # normal: 2^-126 .. 2^126
    e = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # log2(s) + 127
    codes = _e2m1_codes((b / s).clamp_(-FP4_E2M1_MAX, FP4_E2M1_MAX))
    return _pack_mxfp4(codes, e)


def quantize_mxfp4(x: ArrayLike) -> torch.Tensor:
    """Quantize to GGUF MXFP4 with the DeepSeek scale rule (docs/model.md P4; layout docs/gguf-layout.md).

    ``x``: float ``[..., K]`` (used as float32, finite), ``K % 32 == 0``. Per block of 32:
    ``amax = max(max|x|, 6*2^-126)``, ``s = 2^ceil(log2(amax/6))``, exponent byte ``e = log2(s) + 127``
    (so GGUF's ``2^(e-128) * doubled table`` = ``s * e2m1``), codes = e2m1 RNE of ``clamp(x/s, ±6)``; zero
    (including -0.0) is stored as code 0. Returns uint8 ``[..., K/32*17]``.
    """
    return _quantize_blocks(x, "MXFP4", _mxfp4_quant_blocks, 17)


def _e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e-128) as fp32 bits (subnormal 2^-128, 2^-127 for e = 0, 1)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4_dequant_blocks(b: torch.Tensor) -> torch.Tensor:
    d = _e8m0_to_fp32_half(b[:, :1])
    return _codes_to_values(_unpack_mxfp4_codes(b), doubled=True) * d


def dequantize_mxfp4(raw: ArrayLike, shape: Sequence[int]) -> torch.Tensor:
    """Dequantize GGUF MXFP4 bytes (exactly ``nbytes(MXFP4, shape)`` bytes) to float32 of ``shape``:
    value = doubled_e2m1[nibble] * 2^(e-128), bit-identical to ``gguf.quants.dequantize`` for any bytes."""
    blocks, shp = _raw_blocks(raw, GGMLType.MXFP4, shape)
    return _map_blocks(_mxfp4_dequant_blocks, blocks, 32, torch.float32, 32).view(shp)


# ---------------------------------------------------------------------------------------------------------
# K-quants (Q2_K .. Q6_K) and IQ4_XS: super-blocks of 256 values (layouts in the module docstring)
# ---------------------------------------------------------------------------------------------------------

QK_K = 256
"""Values per super-block of the K-quant and IQ4_XS formats."""


class SuperBlock(NamedTuple):
    """One super-block format: ``name`` (the short name kernels' ``fmt`` strings and ``--formats`` use, e.g.
    ``"q4_k"``), ``ggml_type``, ``values`` per super-block (256) and ``nbytes`` per super-block."""

    name: str
    ggml_type: GGMLType
    values: int
    nbytes: int


#: the super-block formats ds4c reads, by GGML type (sizes from :data:`BLOCK`, as ``gguf.GGML_QUANT_SIZES``).
SUPER_BLOCKS: dict = {t: SuperBlock(t.name.lower(), t, *BLOCK[t]) for t in (
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_XS)}

#: short name (``"q2_k"`` .. ``"iq4_xs"``) -> GGML type of the super-block formats.
SUPER_BLOCK_NAMES: dict = {sb.name: t for t, sb in SUPER_BLOCKS.items()}


def super_block(t) -> SuperBlock:
    """The :class:`SuperBlock` of a K-quant / IQ4_XS type given as a GGMLType, its id, its GGML name
    (``"Q4_K"``) or its short name (``"q4_k"``). Raises QuantError (one line) for any other type."""
    if isinstance(t, str) and t.lower() in SUPER_BLOCK_NAMES:
        return SUPER_BLOCKS[SUPER_BLOCK_NAMES[t.lower()]]
    g = _ggml_type(t)
    if g not in SUPER_BLOCKS:
        raise QuantError(f"{g.name} is not a super-block (K-quant / IQ4_XS) type; expected one of "
                         + ", ".join(s.ggml_type.name for s in SUPER_BLOCKS.values()))
    return SUPER_BLOCKS[g]


def is_super_block(t) -> bool:
    """True for the K-quant / IQ4_XS types (rows must be a multiple of 256 values)."""
    try:
        return GGMLType(int(t)) in SUPER_BLOCKS
    except (ValueError, TypeError):
        return False


#: the IQ4_NL / IQ4_XS non-linear 4-bit code table (``gguf.quants.IQ4_NL.kvalues``).
_IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """fp32 of the little-endian fp16 at byte ``at`` of each super-block row: [n, 1]."""
    return b[:, at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(values: Sequence[int], shape: tuple, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).view(shape)


def _q2_k_dequant_blocks(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0xF).to(torch.float32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), b.device)) & 3
    return (dl * q.reshape(n, 16, 16).to(torch.float32) - ml).view(n, QK_K)


def _q3_k_dequant_blocks(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, sc = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    lo = (sc[:, 0:8].reshape(n, 1, 8) >> _shifts((0, 4), (1, 2, 1), b.device)).reshape(n, 16) & 0xF
    hi = (sc[:, 8:12].reshape(n, 1, 4) >> _shifts((0, 2, 4, 6), (1, 4, 1), b.device)).reshape(n, 16) & 3
    scale = ((lo | (hi << 4)).to(torch.int32) - 32).to(torch.float32)
    dl = (d * scale).view(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), b.device)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> _shifts(range(8), (1, 1, 8, 1), b.device)).reshape(n, 16, 16) & 1
    q = (ql.to(torch.int32) - ((qh ^ 1).to(torch.int32) << 2)).to(torch.float32)  # hmask bit 0: q - 4
    return (dl * q).view(n, QK_K)


def _k_scale_min(sc: torch.Tensor) -> tuple:
    """The 8 6-bit scales and 8 6-bit mins of a Q4_K / Q5_K super-block (12 bytes ``sc`` [n, 12]) as fp32
    [n, 8, 1] each."""
    n = sc.shape[0]
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale.to(torch.float32).view(n, 8, 1), mins.to(torch.float32).view(n, 8, 1)


def _q4_k_dequant_blocks(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scale_min(b[:, 4:16])
    q = (b[:, 16:144].reshape(n, 4, 1, 32) >> _shifts((0, 4), (1, 1, 2, 1), b.device)) & 0xF
    return ((d.view(n, 1, 1) * sc) * q.reshape(n, 8, 32).to(torch.float32) - dmin.view(n, 1, 1) * m).view(n, QK_K)


def _q5_k_dequant_blocks(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scale_min(b[:, 4:16])
    ql = (b[:, 48:176].reshape(n, 4, 1, 32) >> _shifts((0, 4), (1, 1, 2, 1), b.device)).reshape(n, 8, 32) & 0xF
    qh = (b[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(range(8), (1, 1, 8, 1), b.device)).reshape(n, 8, 32) & 1
    q = (ql | (qh << 4)).to(torch.float32)
    return ((d.view(n, 1, 1) * sc) * q - dmin.view(n, 1, 1) * m).view(n, QK_K)


def _q6_k_dequant_blocks(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    dl = (_f16(b, 208) * sc).view(n, 16, 1)
    lo = (ql.reshape(n, 2, 1, 64) >> _shifts((0, 4), (1, 1, 2, 1), b.device)).reshape(n, 8, 32) & 0xF
    hi = (qh.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), b.device)).reshape(n, 8, 32) & 3
    q = ((lo | (hi << 4)).to(torch.int32) - 32).to(torch.float32)
    return (dl * q.view(n, 16, 16)).view(n, QK_K)


def _iq4_xs_dequant_blocks(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    sh = b[:, 2:3].to(torch.int32) | (b[:, 3:4].to(torch.int32) << 8)  # little-endian uint16
    hi = (sh >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device).view(1, 8)) & 3
    lo = (b[:, 4:8].reshape(n, 4, 1) >> _shifts((0, 4), (1, 1, 2), b.device)).reshape(n, 8) & 0xF
    scale = ((lo.to(torch.int32) | (hi << 4)) - 32).to(torch.float32)
    dl = (d * scale).view(n, 8, 1)
    codes = (b[:, 8:136].reshape(n, 8, 1, 16) >> _shifts((0, 4), (1, 1, 2, 1), b.device)) & 0xF
    table = torch.tensor(_IQ4_KVALUES, dtype=torch.float32, device=b.device)
    q = table.index_select(0, codes.reshape(-1).to(torch.int32)).view(n, 8, 32)
    return (dl * q).view(n, QK_K)


_SUPER_DEQUANT = {GGMLType.Q2_K: _q2_k_dequant_blocks, GGMLType.Q3_K: _q3_k_dequant_blocks,
                  GGMLType.Q4_K: _q4_k_dequant_blocks, GGMLType.Q5_K: _q5_k_dequant_blocks,
                  GGMLType.Q6_K: _q6_k_dequant_blocks, GGMLType.IQ4_XS: _iq4_xs_dequant_blocks}


def dequantize_super_block(raw: ArrayLike, ggml_type, shape: Sequence[int]) -> torch.Tensor:
    """Dequantize Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS bytes (exactly ``nbytes(type, shape)`` bytes, the
    last dim a multiple of 256) to float32 of ``shape``, on ``raw``'s device; bit-identical to
    ``gguf.quants.dequantize`` for every byte pattern with finite fp16 scales (same fp32 operations in the
    same order; formulas in the module docstring). Raises QuantError for another type or a wrong byte count."""
    t = super_block(ggml_type).ggml_type
    blocks, shp = _raw_blocks(raw, t, shape)
    return _map_blocks(_SUPER_DEQUANT[t], blocks, QK_K, torch.float32, QK_K).view(shp)


# ---------------------------------------------------------------------------------------------------------
# DeepSeek FP4 <-> GGUF MXFP4 repack (docs/model.md 2.1, docs/gguf-layout.md)
# ---------------------------------------------------------------------------------------------------------


def deepseek_fp4_to_mxfp4(packed: ArrayLike, scale_e8m0: ArrayLike) -> torch.Tensor:
    """Exact repack of an official DeepSeek FP4 weight into GGUF MXFP4 (no requantization).

    ``packed``: uint8/int8 ``[..., N, K/2]`` (byte i: element 2i in the low nibble, 2i+1 in the high nibble,
    codes over the plain e2m1 table, sign = bit 3). ``scale_e8m0``: uint8 or ``float8_e8m0fnu``
    ``[..., N, K/32]`` (scale 2^(e-127)). Returns uint8 ``[..., N, K/32*17]``: same codes and the same exponent
    byte per 32-element block (GGUF's doubled table with 2^(e-128) gives identical values).
    """
    p = _to_tensor(packed)
    sc = _to_tensor(scale_e8m0)
    if p.dim() == 0 or sc.dim() == 0:
        raise QuantError("deepseek_fp4_to_mxfp4: expected packed [..., N, K/2] and scale [..., N, K/32], found a scalar")
    if p.element_size() != 1 or p.is_floating_point():
        raise QuantError(f"deepseek_fp4_to_mxfp4: expected packed codes as uint8/int8, found dtype {p.dtype}")
    if sc.element_size() != 1:
        raise QuantError(f"deepseek_fp4_to_mxfp4: expected e8m0 scale bytes (uint8/float8_e8m0fnu), found dtype {sc.dtype}")
    k = p.shape[-1] * 2
    _check_block_dim(k, 32, f"deepseek_fp4_to_mxfp4: packed of shape {tuple(p.shape)} (K = 2 * last dim)")
    if tuple(sc.shape) != tuple(p.shape[:-1]) + (k // 32,):
        raise QuantError(
            f"deepseek_fp4_to_mxfp4: packed of shape {tuple(p.shape)} (K = {k}) needs scale of shape "
            f"{tuple(p.shape[:-1]) + (k // 32,)}, found {tuple(sc.shape)}"
        )
    pb = p.contiguous().view(torch.uint8).reshape(-1, 16)  # one 32-element block per row
    e = sc.contiguous().view(torch.uint8).reshape(-1, 1)
    codes = torch.stack([pb & 0x0F, pb >> 4], dim=-1).reshape(-1, 32)  # even index low nibble
    out = _pack_mxfp4(codes, e)
    return out.view(*p.shape[:-1], k // 32 * 17)


def mxfp4_to_deepseek_fp4(raw: ArrayLike, shape: Sequence[int]) -> tuple:
    """Inverse of :func:`deepseek_fp4_to_mxfp4`: GGUF MXFP4 bytes of logical ``shape`` ``[..., N, K]`` ->
    ``(packed uint8 [..., N, K/2], scale uint8 [..., N, K/32])`` in the DeepSeek layout (even index in the low
    nibble, same exponent bytes)."""
    blocks, shp = _raw_blocks(raw, GGMLType.MXFP4, shape)
    if len(shp) == 0:
        raise QuantError("mxfp4_to_deepseek_fp4: expected a shape with a row dimension, found ()")
    k = shp[-1]
    codes = _unpack_mxfp4_codes(blocks).reshape(-1, 16, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).reshape(*shp[:-1], k // 2)
    scale = blocks[:, 0].contiguous().reshape(*shp[:-1], k // 32)
    return packed, scale


# ---------------------------------------------------------------------------------------------------------
# dispatchers
# ---------------------------------------------------------------------------------------------------------


def dequantize(raw: ArrayLike, ggml_type, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode GGUF tensor data of ``ggml_type`` and torch-order ``shape`` into a ``dtype`` tensor of ``shape``.

    ``raw``: the tensor's bytes in any fixed-size dtype and any shape with exactly ``nbytes(ggml_type, shape)``
    bytes (uint8 bytes, a float32/float16 array, a torch bf16 tensor, a numpy uint16/int16 view of bf16 bits,
    an int32 array, ...). Supported: F32, F16, BF16, I32 (values converted to ``dtype``), Q8_0, MXFP4, the
    K-quants Q2_K .. Q6_K and IQ4_XS (:func:`dequantize_super_block`);
    anything else raises :class:`QuantError` naming the type. Plain types are converted directly from their
    own dtype (bf16 -> bf16 without a fp32 round trip); block types decode to float32 first.
    """
    t = _ggml_type(ggml_type)
    if t == GGMLType.Q8_0:
        out = dequantize_q8_0(raw, shape)
    elif t == GGMLType.MXFP4:
        out = dequantize_mxfp4(raw, shape)
    elif t in SUPER_BLOCKS:
        out = dequantize_super_block(raw, t, shape)
    else:
        shp = _shape(shape)
        need = nbytes(t, shp)
        b = _as_bytes(raw)
        if b.numel() != need:
            src = _to_tensor(raw)
            raise QuantError(
                f"{t.name} data for shape {shp}: expected {need} bytes, found {b.numel()} "
                f"(raw of shape {tuple(src.shape)}, dtype {src.dtype})"
            )
        view_dtype = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16,
                      GGMLType.BF16: torch.bfloat16, GGMLType.I32: torch.int32}[t]
        if b.storage_offset() % torch.empty((), dtype=view_dtype).element_size():
            b = b.clone()  # a misaligned byte slice cannot be reinterpreted in place
        out = b.view(view_dtype).view(shp)
    return out if out.dtype == dtype else out.to(dtype)


def quantize(x: ArrayLike, ggml_type) -> torch.Tensor:
    """Encode ``x`` ``[..., K]`` as ``ggml_type``: uint8 bytes ``[..., nbytes/row]`` for Q8_0 and MXFP4 (see
    :func:`quantize_q8_0`, :func:`quantize_mxfp4`), the plain converted tensor for F32 / F16 / BF16 (RNE casts)
    and I32 (integer input only). Unsupported types raise :class:`QuantError` naming the type; so do the
    K-quants and IQ4_XS, which ds4c reads but does not write (llama.cpp's ``llama-quantize`` makes them; ds4c's
    synthetic models generate their stored codes directly)."""
    t = _ggml_type(ggml_type)
    if t in SUPER_BLOCKS:
        raise QuantError(f"ds4c reads {t.name} but does not quantize to it (llama.cpp's llama-quantize writes "
                         f"K-quant / IQ4_XS files; ds4c's synthetic models generate stored codes directly)")
    if t == GGMLType.Q8_0:
        return quantize_q8_0(x)
    if t == GGMLType.MXFP4:
        return quantize_mxfp4(x)
    src = _to_tensor(x)
    if t == GGMLType.I32:
        if src.is_floating_point() or src.dtype == torch.bool or src.is_complex():
            raise QuantError(f"I32: expected an integer tensor, found dtype {src.dtype}")
        return src.to(torch.int32)
    if not src.is_floating_point():
        raise QuantError(f"{t.name}: expected a floating-point tensor, found dtype {src.dtype}")
    return src.to({GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}[t])
