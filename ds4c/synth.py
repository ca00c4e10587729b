"""Deterministic synthetic DeepSeek-V4-Flash weights: one generator for ``ds4c make-model`` (CPU, into a file)
and for the synthetic weight source (:mod:`ds4c.synth_source`: on any device, no file).

**Determinism.** Every value comes from a counter-based hash: word ``i`` of a stream is splitmix64's mix of
``key + i * 0x9E3779B97F4A7C15`` (:func:`hash_words`), computed on int64 tensors, whose wrapping
multiplication, shifts (made logical by a mask), xor and and give the same bits on every device. A tensor's
key is ``mix(mix(seed) ^ crc32(name))``; its sub-streams (codes, block scales) are keyed from that. Element
and block indices are positions in the tensor, so any row range (one expert, one chunk) is generated on its
own and equals the same rows of the whole tensor, and a tensor's values do not depend on which other tensors
are made or in what order. Floats are built only from exact operations: uniforms are 24-bit integers times
``2^-24``; approximately normal values are a sum of four 16-bit uniforms (Irwin-Hall, unit variance, bounded at
+-3.46 sigma), converted once to float32 and scaled once; every other step is one correctly rounded IEEE
operation (products and sums with float32 constants, casts to bf16/fp16 with round-to-nearest-even). No
transcendental function is evaluated on the device (their last ulp differs between CPU and CUDA). So a
tensor's stored bytes are identical on the CPU and on a GPU (tested on the CPU against a scalar Python oracle
of the hash; docs/synthetic.md).

**Stored forms.** Quantized tensors are generated directly in their stored form, one function per
:class:`~ds4c.quant.GGMLType` (:data:`STORED_GENERATORS`; Q8_0: uniform int8 codes in [-127, 127] with
jittered fp16 block scales; MXFP4: uniform nibbles with jittered e8m0 exponents), so a full-width model needs
no float-to-quant pass and block scales vary the way real ones do. ``--formats bf16`` / ``f32`` store the same
model with FP8/FP4-role tensors dequantized (MXFP4 values are exact in BF16; Q8_0 values are rounded to BF16).

**Statistics.** Scales are chosen so activations stay sane through all layers (see :data:`RESIDUAL_RMS_BAND`
and the test that runs 43 tiny-width layers): projections preserve unit RMS (std = 1/sqrt(fan_in)); the two
sub-block output projections (``wo_b``, expert/shared ``w2``) have gain :data:`OUT_GAIN`, so the HC residual
grows slowly; the HC comb logits favour the diagonal so Sinkhorn converges from a well-conditioned start.

Every synthetic file carries a real byte-level BPE vocabulary of the preset's vocab size with DeepSeek's
special tokens and a chat template (:func:`ds4c.synth_vocab.synthetic_vocab`, deterministic), so text works on
every preset.

The generator replaced numpy PCG64 streams: make-model files of a (preset, seed) have other
bytes than before, once.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ds4c.config import Ds4Config
from ds4c.gguf_file import write_model
from ds4c.quant import BLOCK, GGMLType, dequantize, nbytes
from ds4c.tensors import FORMATS, storage_type, ROLE_BF16, ROLE_F32, ROLE_FP4, ROLE_FP8, ROLE_I32, ROLE_NORM, TensorSpec

OUT_GAIN = 0.25
"""RMS gain of the sub-block output projections relative to a unit-RMS projection."""

RESIDUAL_RMS_BAND = (0.5, 4.0)
"""The RMS of every HC residual stream stays inside this band through 43 layers (tested)."""

HC_COMB_SCALE, HC_COMB_DIAG = 0.2, 1.0
"""Scale of the comb mixing logits and the diagonal bias of the comb base: with these, 20 Sinkhorn
iterations bring rows and columns to 1 within 1e-5 for mixing logits up to ~3 sigma (tested)."""

# --------------------------------------------------------------------------------------------------
# the counter-based hash (splitmix64 on int64 tensors; Python ints for keys and the scalar oracle)

_M64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    c &= _M64
    return c - (1 << 64) if c >> 63 else c


_GOLDEN, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_ROUNDS = ((30, _C1), (27, _C2), (31, None))


def mix64(x: int) -> int:
    """splitmix64's finalizer of the unsigned 64-bit ``x`` (Python ints: the oracle of :func:`hash_words`)."""
    z = x & _M64
    for s, c in _ROUNDS:
        z ^= z >> s
        if c is not None:
            z = (z * c) & _M64
    return z


def word(key: int, i: int) -> int:
    """Word ``i`` of stream ``key`` as an unsigned int (scalar oracle of :func:`hash_words`)."""
    return mix64(key + i * _GOLDEN)


def hash_words(key: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Words ``start .. start+n-1`` of stream ``key``: int64 ``[n]`` on ``device`` (the bits of :func:`word`).

    int64 multiplication wraps and the masked arithmetic shifts are logical shifts, on every device."""
    z = torch.arange(start, start + n, dtype=torch.int64, device=device)
    z *= _s64(_GOLDEN)
    z += _s64(key)
    for s, c in _ROUNDS:
        t = z >> s
        t &= (1 << (64 - s)) - 1
        z ^= t
        if c is not None:
            z *= _s64(c)
    return z


def _shr(h: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``h`` by ``s`` (new tensor)."""
    t = h >> s
    t &= (1 << (64 - s)) - 1
    return t


def tensor_key(seed: int, name: str) -> int:
    """The stream key of tensor ``name`` under ``seed``."""
    return mix64(mix64(int(seed)) ^ zlib.crc32(name.encode()))


def sub_key(key: int, stream: int) -> int:
    """Key of sub-stream ``stream`` (0: codes / values, 1: block scales, ...) of a tensor's ``key``."""
    return mix64(mix64(key) ^ (stream + 1))


def random_bytes(key: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bytes ``start .. start+n-1`` of stream ``key`` (its words' little-endian bytes in order): uint8 ``[n]``."""
    w0, w1 = start // 8, (start + n + 7) // 8
    off = start - 8 * w0
    return hash_words(key, w0, w1 - w0, device).view(torch.uint8)[off:off + n]


def uniform01(key: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[n]`` uniform on ``{0, 2^-24, ..., 1 - 2^-24}`` (the top 24 bits of each word; exact)."""
    u = _shr(hash_words(key, start, n, device), 40).to(torch.float32)
    u *= 2.0 ** -24
    return u


_IH_SD = math.sqrt(4 * (65536.0 ** 2 - 1) / 12)  # std of a sum of four uniform 16-bit integers


def normal01(key: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[n]``, mean 0 and unit variance, approximately normal: the sum of the four 16-bit fields of
    each word (Irwin-Hall of 4), centred exactly in integers, converted once and scaled once."""
    h = hash_words(key, start, n, device)
    s = h & 0xFFFF
    for sh in (16, 32, 48):
        t = _shr(h, sh)
        t &= 0xFFFF
        s += t
    s -= 2 * 65535
    x = s.to(torch.float32)
    x *= _f32(1.0 / _IH_SD)
    return x


def _f32(x: float) -> float:
    """``x`` rounded to float32 (a constant every device multiplies with alike)."""
    return float(np.float32(x))


def _normal(key: int, start: int, n: int, std: float, mean: float = 0.0,
            device: torch.device | str = "cpu") -> torch.Tensor:
    x = normal01(key, start, n, device)
    x *= _f32(std)
    if mean:
        x += _f32(mean)
    return x


# --------------------------------------------------------------------------------------------------
# stored-form generators: rows [r0, r1) of a [rows, k] matrix -> uint8 [r1 - r0, row bytes]

def _q8_0_code_rms() -> float:
    """RMS of the Q8_0 codes: a uniform byte as int8, -128 clamped to -127."""
    vals = [max(b - 256 if b > 127 else b, -127) for b in range(256)]
    return math.sqrt(sum(v * v for v in vals) / 256)


_Q8_RMS = _q8_0_code_rms()
_MX_TABLE = (0, 1, 2, 3, 4, 6, 8, 12)
_MX_RMS = math.sqrt(sum(v * v for v in _MX_TABLE) / 8)  # RMS of the doubled e2m1 table, uniform nibbles


def _q8_0_rows(key: int, r0: int, r1: int, k: int, std: float, device: torch.device | str) -> torch.Tensor:
    """Q8_0 (34-byte blocks: fp16 scale d, 32 int8 codes q; value d*q): uniform codes in [-127, 127] (a byte,
    -128 clamped), d = ``std / rms(q) / sqrt(13/12) * j`` with a per-block jitter j uniform in [0.5, 1.5) (from
    the 16 bits the block's first two bytes held). One byte stream: block b is bytes ``34 b .. 34 b + 33``."""
    per = k // 32
    b0, nb = r0 * per, (r1 - r0) * per
    out = random_bytes(sub_key(key, 0), b0 * 34, nb * 34, device).view(nb, 34)
    out[:, 2:].view(torch.int8).clamp_(min=-127)
    j = out[:, :2].contiguous().view(torch.int16).view(nb).to(torch.int32)
    j &= 0xFFFF
    j += 1 << 15  # j / 2^16 in [0.5, 1.5)
    d = j.to(torch.float32)
    d *= _f32(2.0 ** -16 * std / _Q8_RMS / math.sqrt(13 / 12))
    out[:, :2] = d.to(torch.float16).view(torch.uint8).view(nb, 2)
    return out.view(r1 - r0, per * 34)


def _mxfp4_rows(key: int, r0: int, r1: int, k: int, std: float, device: torch.device | str) -> torch.Tensor:
    """MXFP4 (17-byte blocks: e8m0 exponent, 16 bytes of e2m1 nibbles): uniform nibbles, exponent ``e0 + j``
    with j in {-1, 0, +1} (``(3 x) >> 8`` of the byte x the exponent's place held: 85/86/85 of 256; mean square
    ~1.75) and e0 the nearest giving RMS ``std``. One byte stream: block b is bytes ``17 b .. 17 b + 16``."""
    per = k // 32
    b0, nb = r0 * per, (r1 - r0) * per
    out = random_bytes(sub_key(key, 0), b0 * 17, nb * 17, device).view(nb, 17)
    e0 = round(128 + math.log2(std / _MX_RMS / math.sqrt(1.75)))
    e = out[:, 0].to(torch.int16)
    e *= 3
    e >>= 8
    e += e0 - 1
    out[:, 0] = e.to(torch.uint8)
    return out.view(r1 - r0, per * 17)


#: K-quant / IQ4_XS super-blocks: (byte offset of the fp16 d, of the fp16 dmin or None, dmin / d). With every
#: other byte uniform, dmin = d * E[sub-block scale] * E[code] / E[sub-block min] centres the values at 0.
_KQ_FIELDS = {GGMLType.Q2_K: (80, 82, 1.5), GGMLType.Q3_K: (108, None, 0.0), GGMLType.Q4_K: (0, 2, 7.5),
              GGMLType.Q5_K: (0, 2, 15.5), GGMLType.Q6_K: (208, None, 0.0), GGMLType.IQ4_XS: (0, None, 0.0)}
_KQ_RMS: dict[GGMLType, float] = {}


def _kq_set_scales(out: torch.Tensor, t: GGMLType, scale: torch.Tensor) -> None:
    """Write fp16 ``d = scale`` (and ``dmin = scale * ratio``) into the super-blocks ``out`` uint8 [nb, bytes]."""
    d_off, m_off, ratio = _KQ_FIELDS[t]
    nb = out.shape[0]
    out[:, d_off:d_off + 2] = scale.to(torch.float16).view(torch.uint8).view(nb, 2)
    if m_off is not None:
        out[:, m_off:m_off + 2] = (scale * _f32(ratio)).to(torch.float16).view(torch.uint8).view(nb, 2)


def _kq_rms(t: GGMLType) -> float:
    """RMS of the dequantized values of uniform super-blocks of ``t`` with d = 1 (a constant, computed once on
    the CPU from a fixed stream, so every device scales alike)."""
    if t not in _KQ_RMS:
        bb = BLOCK[t][1]
        out = random_bytes(sub_key(0x5EED, int(t)), 0, 4096 * bb).view(4096, bb).clone()
        _kq_set_scales(out, t, torch.ones(4096))
        _KQ_RMS[t] = float(dequantize(out, t, (4096, 256)).square().mean().sqrt())
    return _KQ_RMS[t]


def _kquant_rows(t: GGMLType) -> "StoredGenerator":
    """The generator of K-quant / IQ4_XS type ``t``: every byte of a super-block uniform (codes, packed
    sub-block scales and mins, high-bit planes) except the fp16 ``d`` (and ``dmin``): ``d = std / rms_1 /
    sqrt(13/12) * j`` with a jitter j uniform in [0.5, 1.5) from the 16 bits ``d``'s place held, as Q8_0.
    One byte stream: super-block b is bytes ``B b .. B b + B - 1`` (B its size)."""
    bb = BLOCK[t][1]

    def rows(key: int, r0: int, r1: int, k: int, std: float, device: torch.device | str) -> torch.Tensor:
        per = k // 256
        b0, nb = r0 * per, (r1 - r0) * per
        out = random_bytes(sub_key(key, 0), b0 * bb, nb * bb, device).view(nb, bb)
        d_off = _KQ_FIELDS[t][0]
        j = out[:, d_off:d_off + 2].contiguous().view(torch.int16).view(nb).to(torch.int32)
        j &= 0xFFFF
        j += 1 << 15  # j / 2^16 in [0.5, 1.5)
        d = j.to(torch.float32)
        d *= _f32(2.0 ** -16 * std / _kq_rms(t) / math.sqrt(13 / 12))
        _kq_set_scales(out, t, d)
        return out.view(r1 - r0, per * bb)

    return rows


StoredGenerator = Callable[[int, int, int, int, float, "torch.device | str"], torch.Tensor]

STORED_GENERATORS: dict[GGMLType, StoredGenerator] = {GGMLType.Q8_0: _q8_0_rows, GGMLType.MXFP4: _mxfp4_rows,
                                                      **{t: _kquant_rows(t) for t in _KQ_FIELDS}}
"""``type -> fn(key, r0, r1, k, std, device)``: rows ``[r0, r1)`` of a ``[rows, k]`` matrix in that type's
stored form (uint8 ``[r1 - r0, row bytes]``), dequantized RMS ~ ``std``, mean ~ 0. Quantized types are
generated directly through this table (a new format adds one entry)."""

_FLOAT_DTYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


def _as_stored(x: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """float32 values -> the stored bytes of float type ``t`` (uint8, same leading shape)."""
    try:
        dt = _FLOAT_DTYPES[t]
    except KeyError:
        raise ValueError(f"not a float type: {t.name}") from None
    y = x if dt == torch.float32 else x.to(dt)
    return y.contiguous().view(torch.uint8)


def official_type(role: str) -> GGMLType:
    """The type the official checkpoint's stored form of an FP8/FP4-role weight maps to (Q8_0 / MXFP4)."""
    return GGMLType.MXFP4 if role == ROLE_FP4 else GGMLType.Q8_0


def matrix_rows(key: int, role: str, t: GGMLType, r0: int, r1: int, k: int, std: float,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows ``[r0, r1)`` of a projection / embedding matrix ``[rows, k]`` of ``role`` stored as ``t``: uint8
    ``[r1 - r0, row bytes]``. A quantized ``t`` is generated directly (:data:`STORED_GENERATORS`); a float
    ``t`` of an FP8/FP4-role weight holds its official stored form dequantized (the same model in wider
    storage); of a BF16-role weight, bf16-rounded normal values."""
    gen = STORED_GENERATORS.get(t)
    if gen is not None:
        return gen(key, r0, r1, k, std, device)
    if role in (ROLE_FP8, ROLE_FP4):
        off = official_type(role)
        raw = STORED_GENERATORS[off](key, r0, r1, k, std, device)
        return _as_stored(dequantize(raw, off, (r1 - r0, k)), t)
    x = _normal(sub_key(key, 0), r0 * k, (r1 - r0) * k, std, device=device).view(r1 - r0, k)
    return _as_stored(x.to(torch.bfloat16).float(), t)


# --------------------------------------------------------------------------------------------------
# per tensor

def _std(cfg: Ds4Config, spec: TensorSpec) -> float:
    """Target standard deviation of a projection weight (1/sqrt(fan_in), output gains applied)."""
    if spec.name == "token_embd.weight":
        return 1.0
    out_proj = any(k in spec.name for k in ("attn_output_b", "ffn_down_exps", "ffn_down_shexp"))
    return (OUT_GAIN if out_proj else 1.0) / math.sqrt(spec.shape[-1])


def is_matrix(spec: TensorSpec) -> bool:
    """Projections, experts, embedding and head: generated by rows (:func:`tensor_rows`)."""
    return spec.role in (ROLE_FP8, ROLE_FP4, ROLE_BF16)


def n_rows(spec: TensorSpec) -> int:
    """Rows of a tensor's ``[rows, k]`` matrix view (experts stacked: ``n_expert * out``)."""
    return spec.numel // spec.shape[-1]


def tensor_rows(cfg: Ds4Config, spec: TensorSpec, t: GGMLType, seed: int, r0: int, r1: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows ``[r0, r1)`` of matrix tensor ``spec`` stored as ``t``: uint8 ``[r1 - r0, row bytes]``."""
    return matrix_rows(tensor_key(seed, spec.name), spec.role, t, r0, r1, spec.shape[-1], _std(cfg, spec), device)


def _small(cfg: Ds4Config, spec: TensorSpec, key: int, device: torch.device | str) -> torch.Tensor:
    """float32 values of the non-projection tensors (norm gains, HC params, ape, sinks, biases)."""
    n, shape = spec.name, spec.shape
    k0 = sub_key(key, 0)

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return _normal(k0, 0, spec.numel, std, mean, device).view(shape)

    if n.endswith("norm.weight"):
        return normal(0.05, 1.0)
    if n.endswith("hc_attn_fn.weight") or n.endswith("hc_ffn_fn.weight") or n == "output_hc_fn.weight":
        return normal(1 / math.sqrt(cfg.hc_dim))
    if n.endswith("_scale.weight"):  # pre, post, comb logit scales (the head has only the first)
        x = normal(0.02)
        x += torch.tensor([0.5, 0.5, HC_COMB_SCALE], dtype=torch.float32, device=device)[: shape[0]]
        return x
    if n.endswith("hc_attn_base.weight") or n.endswith("hc_ffn_base.weight"):
        hc = cfg.hc_mult
        base = normal(0.2)
        base[2 * hc:].view(hc, hc).add_(torch.eye(hc, dtype=torch.float32, device=device) * HC_COMB_DIAG)
        return base  # the diagonal bias favours keeping each stream
    if n == "output_hc_base.weight":
        return normal(0.2)
    if n.endswith("attn_sinks.weight"):
        return normal(1.0)
    if n.endswith("_ape.weight"):
        return normal(0.5)
    if n.endswith("exp_probs_b.bias"):
        return normal(0.1)
    raise AssertionError(f"no synthetic rule for {n}")


_TID_CHUNK = 1 << 14


def _tid2eid_rows(cfg: Ds4Config, key: int, r0: int, r1: int, device: torch.device | str) -> torch.Tensor:
    """Hash routing table rows (tokens) ``[r0, r1)``: for every token, ``n_active`` distinct expert ids, the
    experts of the smallest of unique per-token int32 keys (hash bits above 8, the expert id below; two keys per
    word), smallest first: int32 ``[r1 - r0, n_active]``."""
    E = cfg.n_experts
    assert E <= 256 and E % 2 == 0, E
    h = hash_words(sub_key(key, 0), r0 * E // 2, (r1 - r0) * E // 2, device).view(torch.int32).view(r1 - r0, E)
    h &= ~0xFF
    h |= torch.arange(E, dtype=torch.int32, device=device)
    keys = torch.topk(h, cfg.n_active_experts, dim=1, largest=False, sorted=True).values
    keys &= 0xFF
    return keys


def small_tensor(cfg: Ds4Config, spec: TensorSpec, t: GGMLType, seed: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """A non-matrix tensor's stored bytes: uint8 ``[numel * element size]`` (I32: ``tid2eid``)."""
    key = tensor_key(seed, spec.name)
    if spec.role == ROLE_I32:
        rows = cfg.vocab_size
        out = torch.empty((rows, cfg.n_active_experts), dtype=torch.int32, device=device)
        for a in range(0, rows, _TID_CHUNK):
            b = min(rows, a + _TID_CHUNK)
            out[a:b] = _tid2eid_rows(cfg, key, a, b, device)
        return out.view(-1).view(torch.uint8)
    assert spec.role in (ROLE_F32, ROLE_NORM), spec
    x = _small(cfg, spec, key, device)
    if spec.role == ROLE_NORM:  # BF16 in the checkpoint: bf16 values, whatever type stores them
        x = x.to(torch.bfloat16).float()
    return _as_stored(x, t).reshape(-1)


#: Hash words per generated piece: small on the CPU (the temporaries stay in cache), larger on a GPU (few
#: launches; transients of a few hundred MiB).
_PIECE_WORDS = {"cpu": 1 << 16, "cuda": 1 << 23}


def piece_rows(spec: TensorSpec, t: GGMLType, device: torch.device | str) -> int:
    """Rows per generated piece of matrix ``spec`` stored as ``t`` on ``device`` (about the same number of hash
    words per piece whatever the type: a quantized row takes its bytes / 8 words, a float row one per value)."""
    k = spec.shape[-1]
    words = k if t in _FLOAT_DTYPES else max(1, nbytes(t, (1, k)) // 8)
    return max(1, _PIECE_WORDS.get(torch.device(device).type, 1 << 23) // words)


def stored_pieces(cfg: Ds4Config, spec: TensorSpec, t: GGMLType, seed: int, r0: int = 0, r1: int | None = None,
                  device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
    """The stored bytes of tensor ``spec`` as ``t`` (matrix rows ``[r0, r1)``, default all) in pieces of whole
    rows, each a uint8 tensor on ``device``; concatenated they are the tensor's bytes in the file."""
    if not is_matrix(spec):
        yield small_tensor(cfg, spec, t, seed, device)
        return
    r1 = n_rows(spec) if r1 is None else r1
    step = piece_rows(spec, t, device)
    for a in range(r0, r1, step):
        yield tensor_rows(cfg, spec, t, seed, a, min(r1, a + step), device)


def producer(cfg: Ds4Config, seed: int) -> Callable[[TensorSpec, GGMLType], Iterator[np.ndarray]]:
    """The ``produce(spec, type)`` callback of :func:`ds4c.gguf_file.write_model` for synthetic weights (the
    generator on the CPU)."""

    def produce(spec: TensorSpec, t: GGMLType) -> Iterator[np.ndarray]:
        for piece in stored_pieces(cfg, spec, t, seed):
            yield piece.numpy()

    return produce


class _Pipelined:
    """A producer that generates on a worker thread (torch ops release the GIL) while ``write_model`` writes on
    the calling one, a few pieces ahead, in ``specs`` order (the worker runs :func:`producer`, started at the
    first tensor asked for); pieces and errors travel through a bounded queue. ``close()`` stops the worker (a
    failed or interrupted write)."""

    _END = object()

    def __init__(self, cfg: Ds4Config, seed: int, types: dict[str, GGMLType], specs: list[TensorSpec],
                 depth: int = 16):
        import queue
        import threading

        self._q: "queue.Queue[Any]" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._full = queue.Full

        def work() -> None:
            try:
                produce = producer(cfg, seed)
                for spec in specs:
                    for piece in produce(spec, storage_type(spec, types)):
                        if not self._put((spec.name, piece)):
                            return
                    if not self._put((spec.name, self._END)):
                        return
            except BaseException as e:  # handed to the writer, which raises it
                self._put((None, e))

        self._thread = threading.Thread(target=work, name="ds4c-synth", daemon=True)
        self._started = False

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except self._full:
                pass
        return False

    def __call__(self, spec: TensorSpec, t: GGMLType) -> Iterator[np.ndarray]:
        if not self._started:  # on the first tensor: the writer has made its temporary and written the header
            self._started = True
            self._thread.start()
        while True:
            name, piece = self._q.get()
            if name is None:
                raise piece
            assert name == spec.name, (name, spec.name)  # write_model asks in specs order
            if piece is self._END:
                return
            yield piece

    def close(self) -> None:
        self._stop.set()
        if self._started:
            self._thread.join()


def make_model(cfg: Ds4Config, path: str | Path, seed: int = 0, formats: str = "official",
               progress: Callable[[TensorSpec, int], None] | None = None) -> Path:
    """Write a synthetic model file for ``cfg`` (see module docstring).

    The tensors are generated on the CPU by one worker thread (torch at one intra-op thread: the pieces are
    small, so that is the fastest) while the file is written, so generation and writing overlap.

    Args:
        cfg: the config (e.g. ``ds4c.config.preset("tiny")``).
        path: output file; written atomically.
        seed: the random seed; the same (cfg, seed, formats) always gives the same bytes, and the same tensors
            as ``SyntheticModel`` (:mod:`ds4c.synth_source`) of that (preset, formats, seed) on any device.
        formats: a key of :data:`ds4c.tensors.FORMATS` (``"official"``: Q8_0 for FP8 weights, MXFP4 experts,
            BF16/F32 as spec 2.1; ``"bf16"``, ``"f32"``; each tensor's type: :func:`ds4c.tensors.storage_type`).
        progress: optional per-tensor callback ``(spec, bytes_written)``.

    Raises:
        ConfigError: unknown ``formats``.
    """
    from ds4c.errors import ConfigError
    from ds4c.tensors import tensor_specs

    if formats not in FORMATS:
        raise ConfigError(f"unknown formats {formats!r}: expected one of {sorted(FORMATS)}")
    from ds4c.synth_vocab import synthetic_vocab

    tok = synthetic_vocab(cfg.vocab_size, seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    produce = _Pipelined(cfg, seed, FORMATS[formats], tensor_specs(cfg))
    try:
        return write_model(path, cfg, FORMATS[formats], produce, extra_metadata=extra_metadata(seed, formats),
                           progress=progress, tokenizer=tok)
    finally:
        produce.close()
        torch.set_num_threads(threads)


def extra_metadata(seed: int, formats: str) -> dict[str, object]:
    """The ``ds4c.*`` keys a synthetic model carries."""
    return {"ds4c.synthetic_seed": int(seed), "ds4c.formats": formats}
