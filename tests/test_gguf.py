"""Tests of ds4c.gguf_file, ds4c.tensors and ds4c.synth: the tiny model file against the tensor inventory of
spec gguf-deepseek4.md, determinism of synthetic weights, official vs bf16 storage, write/read round trips of
known values, atomic writes, and the errors for bad files (each names the tensor, or the architecture /
truncation)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pytest
import torch
from gguf import GGUFValueType, GGUFWriter

from ds4c.config import ARCH, preset, to_gguf_metadata
from ds4c.errors import ModelFileError
from ds4c.gguf_file import add_metadata_entries, ModelFile, write_model
from ds4c.sources import open_model
from ds4c.quant import GGMLType, dequantize, nbytes, quantize
from ds4c.synth import make_model, producer
from ds4c.tensors import (
    ACCEPTED_TYPES,
    FORMATS,
    ROLE_BF16,
    ROLE_NORM,
    ROLE_F32,
    ROLE_FP4,
    ROLE_FP8,
    ROLE_I32,
    TensorSpec,
    tensor_specs,
)

TINY = preset("tiny")
G = GGMLType


# ------------------------------------------------------------------------------------------------ helpers

def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 tensor -> its int32 bit patterns (bit-identity, -0.0 != 0.0)."""
    return t.to(torch.float32).contiguous().view(torch.int32)


def bf16_bytes(x: np.ndarray | torch.Tensor) -> np.ndarray:
    t = torch.as_tensor(np.asarray(x, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy()


def write_gguf(path: Path, metadata: list[tuple[str, Any, str]], tensors: Iterable[tuple[str, np.ndarray, GGMLType]],
               arch: str = ARCH) -> Path:
    """Write a GGUF with gguf.GGUFWriter directly (no ds4c code): metadata ``(key, value, kind)`` with kind in
    str/u32/u64/f32/bool/arr_i32/arr_u32/arr_f32/arr_str; tensors ``(name, stored data, ggml type)``; uint8 data of a block or
    bf16 type is in bytes per row, other data in elements (torch order)."""
    w = GGUFWriter(str(path), arch)
    add_metadata_entries(w, metadata)
    for name, data, t in tensors:
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def copy_model(src: ModelFile, path: Path, *, drop: tuple[str, ...] = (),
               replace: dict[str, tuple[np.ndarray, GGMLType]] | None = None,
               extra_tensors: list[tuple[str, np.ndarray, GGMLType]] | None = None,
               meta_set: dict[str, tuple[Any, str]] | None = None, meta_drop: tuple[str, ...] = (),
               arch: str = ARCH) -> Path:
    """Re-write the model of ``src`` into ``path`` with exactly one kind of change."""
    meta = [(k, v, kind) for k, v, kind in to_gguf_metadata(src.config) if k not in meta_drop]
    for k, (v, kind) in (meta_set or {}).items():
        meta = [m for m in meta if m[0] != k] + [(k, v, kind)]
    replace = replace or {}
    tensors = []
    for name in src.specs:
        if name in drop:
            continue
        if name in replace:
            tensors.append((name, *replace[name]))
        else:
            tensors.append((name, np.asarray(src.raw(name)), src.ggml_type(name)))
    tensors += extra_tensors or []
    return write_gguf(path, meta, tensors, arch=arch)


@pytest.fixture(scope="module")
def tiny(tiny_path) -> ModelFile:
    return open_model(tiny_path)


@pytest.fixture(scope="module")
def tiny_bf16(tiny_bf16_path) -> ModelFile:
    return open_model(tiny_bf16_path)


# ------------------------------------------------------------------------------------------------ inventory

def test_tiny_opens_with_every_spec_tensor(tiny):
    specs = tensor_specs(TINY)
    assert tiny.config == TINY
    assert list(tiny.specs) == [s.name for s in specs]
    assert tiny.n_tensors == len(specs) == 178
    for s in specs:
        assert tiny.ggml_type(s.name) == FORMATS["official"][s.role], s.name
        t = tiny.tensor(s.name)
        assert tuple(t.shape) == s.shape, s.name
        if s.role == ROLE_I32:
            assert t.dtype == torch.int64
            assert int(t.min()) >= 0 and int(t.max()) < TINY.n_experts
            # n_active distinct experts per token
            assert (t.sort(-1).values.diff(dim=-1) > 0).all(), s.name
        else:
            assert t.dtype == torch.float32
            assert torch.isfinite(t).all(), s.name
            assert t.std().item() > 0 if t.numel() > 1 else t.abs().item() > 0, s.name


def test_tiny_inventory_matches_gguf_spec_shapes(tiny):
    """A few shapes written out from the spec table (ggml order reversed), tiny widths."""
    D, H, hd, E, F = 256, 4, 192, 16, 128
    want = {
        "token_embd.weight": (512, D), "output.weight": (512, D), "output_norm.weight": (D,),
        "output_hc_fn.weight": (4, 4 * D), "output_hc_base.weight": (4,),
        "output_hc_scale.weight": (1,),
        "blk.0.hc_attn_fn.weight": (24, 4 * D), "blk.0.hc_ffn_base.weight": (24,),
        "blk.0.hc_attn_scale.weight": (3,),
        "blk.0.attn_q_a.weight": (128, D), "blk.0.attn_q_b.weight": (H * hd, 128), "blk.0.attn_kv.weight": (hd, D),
        "blk.0.attn_output_a.weight": (2 * 64, 2 * hd), "blk.0.attn_output_b.weight": (D, 2 * 64),
        "blk.0.attn_sinks.weight": (H,), "blk.0.ffn_gate_tid2eid.weight": (512, 4),
        "blk.2.attn_compressor_kv.weight": (2 * hd, D), "blk.2.attn_compressor_ape.weight": (4, 2 * hd),
        "blk.3.attn_compressor_gate.weight": (hd, D), "blk.3.attn_compressor_ape.weight": (16, hd),
        "blk.2.indexer.attn_q_b.weight": (4 * 128, 128), "blk.2.indexer.proj.weight": (4, D),
        "blk.4.indexer_compressor_kv.weight": (256, D), "blk.4.indexer_compressor_ape.weight": (4, 256),
        "blk.4.indexer_compressor_norm.weight": (128,), "blk.3.exp_probs_b.bias": (E,),
        "blk.5.ffn_gate_exps.weight": (E, F, D), "blk.5.ffn_down_exps.weight": (E, D, F),
        "blk.5.ffn_down_shexp.weight": (D, F), "blk.5.ffn_gate_inp.weight": (E, D),
    }
    for name, shape in want.items():
        assert tiny.specs[name].shape == shape, name
        assert tuple(tiny.tensor(name).shape) == shape, name
    names = set(tiny.specs)
    # indexer only on CSA layers; compressor on CSA+HCA; tid2eid on hash layers, bias on scored layers
    assert {n.split(".")[1] for n in names if ".indexer." in n} == {"2", "4"}
    assert {n.split(".")[1] for n in names if "attn_compressor_kv" in n} == {"2", "3", "4", "5"}
    assert {n.split(".")[1] for n in names if "tid2eid" in n} == {"0", "1", "2"}
    assert {n.split(".")[1] for n in names if "exp_probs_b" in n} == {"3", "4", "5"}


def test_bytes_by_type_add_up(tiny, tiny_path):
    want: dict[str, list[int]] = {}
    for s in tensor_specs(TINY):
        t = FORMATS["official"][s.role]
        c = want.setdefault(t.name, [0, 0])
        c[0] += 1
        c[1] += nbytes(t, s.shape)
    got = tiny.weight_bytes_by_type()
    assert {k: tuple(v) for k, v in want.items()} == got
    assert got["MXFP4"][0] == 18 and got["I32"][0] == 3
    assert got["MXFP4"][1] == 6 * 3 * 16 * 128 * 256 // 32 * 17
    total = sum(b for _, b in got.values())
    size = tiny_path.stat().st_size
    assert total < size < total + 64 * 1024  # header + alignment padding only


# ------------------------------------------------------------------------------------------------ synth

def test_same_seed_same_bytes_different_seed_different(tmp_path, tiny_path, tiny):
    again = make_model(TINY, tmp_path / "again.gguf", seed=0)
    assert again.read_bytes() == tiny_path.read_bytes()
    other = open_model(make_model(TINY, tmp_path / "seed1.gguf", seed=1))
    assert other.metadata["ds4c.synthetic_seed"] == 1 and tiny.metadata["ds4c.synthetic_seed"] == 0
    assert other.config == tiny.config
    for name in tiny.specs:  # every tensor is random: every tensor changes with the seed
        assert not np.array_equal(np.asarray(other.raw(name)), np.asarray(tiny.raw(name))), name


def test_official_and_bf16_formats_hold_the_same_model(tiny, tiny_bf16):
    assert tiny_bf16.metadata["ds4c.formats"] == "bf16"
    assert tiny_bf16.config == tiny.config
    rounded_some = False
    for name, s in tiny.specs.items():
        assert tiny_bf16.ggml_type(name) == FORMATS["bf16"][s.role], name
        a, b = tiny.tensor(name), tiny_bf16.tensor(name)
        if s.role == ROLE_FP4:  # MXFP4 values are exact in bf16
            assert tiny.ggml_type(name) == G.MXFP4
            assert torch.equal(bits(a), bits(b)), name
        elif s.role == ROLE_FP8:  # Q8_0 values rounded once to bf16
            assert tiny.ggml_type(name) == G.Q8_0
            assert torch.equal(bits(b), bits(a.to(torch.bfloat16))), name
            rel = ((a - b).abs() / a.abs().clamp_min(1e-30)).max().item()
            assert rel < 1e-2, name
            rounded_some |= rel > 0
        elif s.role == ROLE_I32:
            assert torch.equal(a, b), name
        else:
            assert torch.equal(bits(a), bits(b)), name
            assert np.array_equal(np.asarray(tiny.raw(name)), np.asarray(tiny_bf16.raw(name))), name
    assert rounded_some  # Q8_0 values are not all bf16-exact: the comparison above is not vacuous


@pytest.mark.parametrize("fixture", ["tiny", "tiny_bf16"])
def test_expert_equals_slice_of_tensor(fixture, request):
    mf = request.getfixturevalue(fixture)
    for layer in (0, 5):
        for kind in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{kind}_exps.weight"
            full = mf.tensor(name)
            for e in (0, 7, 15):
                x = mf.expert(name, e)
                assert tuple(x.shape) == mf.specs[name].shape[1:]
                assert torch.equal(bits(x), bits(full[e])), (name, e)
            assert not torch.equal(mf.expert(name, 0), mf.expert(name, 1))
    with pytest.raises(ModelFileError, match=r"expert index 16 out of range 0\.\.15"):
        mf.expert("blk.0.ffn_up_exps.weight", 16)
    with pytest.raises(ModelFileError, match=r"expert index -1"):
        mf.expert("blk.0.ffn_up_exps.weight", -1)


def test_unknown_tensor_name(tiny):
    with pytest.raises(ModelFileError, match=r"no tensor named 'blk\.9\.attn_kv\.weight'"):
        tiny.tensor("blk.9.attn_kv.weight")


# ------------------------------------------------------------------------------------------------ write / read

def _q8_known(rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-made Q8_0 bytes (spec: fp16 d then 32 int8 q; value d*q) and their exact values."""
    nb = rows * k // 32
    d = (2.0 ** -(np.arange(nb) % 7 + 2)).astype(np.float16)
    q = ((np.arange(nb * 32).reshape(nb, 32) * 37) % 255 - 127).astype(np.int8)
    blk = np.empty((nb, 34), np.uint8)
    blk[:, :2] = d.view(np.uint8).reshape(nb, 2)
    blk[:, 2:] = q.view(np.uint8)
    vals = d.astype(np.float32)[:, None] * q.astype(np.float32)
    return blk.reshape(rows, -1), vals.reshape(rows, k)


def _mxfp4_known(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Hand-made MXFP4 bytes (spec: e8m0 byte e, byte j = element j low nibble | element j+16 high nibble;
    doubled e2m1 table; scale 2^(e-128)) and their exact values."""
    table = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
    k = shape[-1]
    nb = int(np.prod(shape)) // 32
    e = (120 + np.arange(nb) % 13).astype(np.uint8)
    codes = ((np.arange(nb * 32).reshape(nb, 32) * 5 + np.arange(nb)[:, None]) % 16).astype(np.uint8)
    blk = np.empty((nb, 17), np.uint8)
    blk[:, 0] = e
    blk[:, 1:] = codes[:, :16] | (codes[:, 16:] << 4)
    vals = table[codes] * np.exp2(e.astype(np.float32) - 128)[:, None]
    return blk.reshape(*shape[:-1], k // 32 * 17), vals.reshape(shape)


def test_write_read_round_trip_of_known_values(tmp_path, tiny):
    H, D = TINY.n_heads, TINY.hidden_size
    known_vals: dict[str, np.ndarray] = {
        "blk.0.attn_sinks.weight": np.arange(H, dtype=np.float32) * 0.75 - 1.25,
        "output_norm.weight": (np.arange(D, dtype=np.float32) - 100) / 64,  # bf16-exact
        "blk.0.ffn_gate_tid2eid.weight": ((np.arange(512)[:, None] * 5 + np.arange(4)) % 16).astype(np.int32),
    }
    known_raw: dict[str, np.ndarray] = {
        "blk.0.attn_sinks.weight": known_vals["blk.0.attn_sinks.weight"],
        "output_norm.weight": known_vals["output_norm.weight"],  # 1-D: F32 as llama.cpp's converter writes
        "blk.0.ffn_gate_tid2eid.weight": known_vals["blk.0.ffn_gate_tid2eid.weight"],
    }
    known_raw["blk.3.attn_q_a.weight"], known_vals["blk.3.attn_q_a.weight"] = _q8_known(128, D)
    shape = TINY.n_experts, TINY.moe_inter, D
    known_raw["blk.1.ffn_up_exps.weight"], known_vals["blk.1.ffn_up_exps.weight"] = _mxfp4_known(shape)
    synth = producer(TINY, 0)

    def produce(spec: TensorSpec, t: GGMLType):
        if spec.name in known_raw:
            yield known_raw[spec.name]
        else:
            yield from synth(spec, t)

    path = write_model(tmp_path / "known.gguf", TINY, FORMATS["official"], produce,
                       extra_metadata={"ds4c.note": "known", "ds4c.count": 7, "ds4c.ratio": 0.5, "ds4c.flag": True})
    mf = open_model(path)
    for name, vals in known_vals.items():
        got = mf.tensor(name).numpy()
        assert got.shape == vals.shape
        np.testing.assert_array_equal(got, vals.astype(got.dtype), err_msg=name)
    assert float(np.abs(known_vals["blk.1.ffn_up_exps.weight"]).max()) > 0
    e3 = mf.expert("blk.1.ffn_up_exps.weight", 3).numpy()
    np.testing.assert_array_equal(e3, known_vals["blk.1.ffn_up_exps.weight"][3])
    # every other tensor is byte-identical to the plain synthetic file (per-tensor random streams)
    for name in tiny.specs:
        if name not in known_raw:
            assert np.array_equal(np.asarray(mf.raw(name)), np.asarray(tiny.raw(name))), name
    assert mf.metadata["ds4c.note"] == "known" and mf.metadata["ds4c.count"] == 7
    assert mf.metadata["ds4c.ratio"] == 0.5 and mf.metadata["ds4c.flag"] is True


def test_wider_storage_types_are_accepted(tmp_path):
    """Quantized roles may be stored wider (spec: FP8 weights as Q8_0 or BF16; here F32 / Q8_0 / F16)."""
    types = {ROLE_FP8: G.F32, ROLE_FP4: G.Q8_0, ROLE_BF16: G.F16, ROLE_NORM: G.F16, ROLE_F32: G.F32,
             ROLE_I32: G.I32}
    for role, t in types.items():
        assert t in ACCEPTED_TYPES[role]
    synth = producer(TINY, 3)
    vals: dict[str, torch.Tensor] = {}

    def produce(spec: TensorSpec, t: GGMLType):
        if spec.role == ROLE_I32:
            yield from synth(spec, t)
            return
        g = torch.Generator().manual_seed(len(vals) + 1)
        x = torch.randn(spec.shape, generator=g) * 0.1 + 0.01
        q = quantize(x, t)
        vals[spec.name] = dequantize(q, t, spec.shape)
        yield q.numpy()

    mf = open_model(write_model(tmp_path / "wide.gguf", TINY, types, produce))
    for name, s in mf.specs.items():
        assert mf.ggml_type(name) == types[s.role], name
    for name in ("blk.0.attn_q_b.weight", "blk.2.ffn_down_exps.weight", "output.weight", "blk.4.attn_norm.weight",
                 "blk.5.hc_ffn_fn.weight"):
        assert torch.equal(bits(mf.tensor(name)), bits(vals[name])), name
        assert vals[name].abs().max() > 0
    x = mf.expert("blk.2.ffn_down_exps.weight", 9)
    assert torch.equal(bits(x), bits(vals["blk.2.ffn_down_exps.weight"][9]))


def test_written_file_mode_follows_umask(tmp_path):
    old = os.umask(0o022)
    try:
        p = make_model(TINY, tmp_path / "mode.gguf", seed=0)
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


# ------------------------------------------------------------------------------------------------ atomic write

def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _open_handles_into(folder: Path) -> list[str]:
    """Paths under ``folder`` this process still holds open (Linux /proc; a deleted temp file shows with
    a " (deleted)" suffix and still occupies its disk space)."""
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():
        pytest.skip("needs /proc/self/fd")
    out = []
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(folder)):
            out.append(target)
    return out


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failed_write_leaves_nothing(tmp_path, exc):
    synth = producer(TINY, 0)
    seen = []

    def produce(spec, t):
        seen.append(spec.name)
        if spec.name == "blk.2.attn_kv.weight":
            yield np.zeros(10, np.uint8)  # some bytes already written for this tensor
            raise exc("boom")
        yield from synth(spec, t)

    with pytest.raises(exc, match="boom") as ei:
        write_model(tmp_path / "x.gguf", TINY, FORMATS["official"], produce)
    assert len(seen) > 30  # failed midway, not at the start
    assert _leftovers(tmp_path) == []
    # the traceback (held by `ei`) must not keep the deleted temporary file open
    assert ei.traceback is not None and _open_handles_into(tmp_path) == []


def test_failed_write_keeps_existing_file(tmp_path, tiny_path):
    dst = tmp_path / "m.gguf"
    shutil.copy(tiny_path, dst)
    before = dst.read_bytes()
    synth = producer(TINY, 5)

    def produce(spec, t):
        if spec.name == "output.weight":
            raise ValueError("late failure")
        yield from synth(spec, t)

    with pytest.raises(ValueError, match="late failure"):
        write_model(dst, TINY, FORMATS["official"], produce)
    assert dst.read_bytes() == before
    assert _leftovers(tmp_path) == ["m.gguf"]


@pytest.mark.parametrize("delta", [-1, 1, -34])
def test_producer_wrong_byte_count(tmp_path, delta):
    synth = producer(TINY, 0)
    target = "blk.1.attn_q_b.weight"

    def produce(spec, t):
        if spec.name == target:
            raw = np.concatenate([np.asarray(c).view(np.uint8).reshape(-1) for c in synth(spec, t)])
            yield raw[:delta] if delta < 0 else np.concatenate([raw, np.ones(delta, np.uint8)])
        else:
            yield from synth(spec, t)

    want = nbytes(G.Q8_0, (TINY.n_heads * TINY.head_dim, TINY.q_lora_rank))
    with pytest.raises(ModelFileError, match=rf"{target}.*gave {want + delta} bytes, expected {want}") as ei:
        write_model(tmp_path / "bad.gguf", TINY, FORMATS["official"], produce)
    assert _leftovers(tmp_path) == []
    assert ei.traceback is not None and _open_handles_into(tmp_path) == []


# ------------------------------------------------------------------------------------------------ bad files

def test_faithful_copy_opens(tmp_path, tiny):
    """The copy helper itself: an unchanged copy opens with identical tensors (so the bad-file tests below
    change exactly one thing)."""
    mf = open_model(copy_model(tiny, tmp_path / "copy.gguf"))
    assert mf.config == tiny.config
    for name in tiny.specs:
        assert np.array_equal(np.asarray(mf.raw(name)), np.asarray(tiny.raw(name))), name
        assert mf.ggml_type(name) == tiny.ggml_type(name)


def test_extra_tensors_and_tokenizer_keys_are_ignored(tmp_path, tiny):
    # one token per embedding row: a list of another length is a vocabulary mismatch (its own test)
    tokens = ["<bos>", "<eos>", "a", "b", "Ġthe"] + [f"[PAD{i}]" for i in range(5, TINY.vocab_size)]
    p = copy_model(
        tiny, tmp_path / "extra.gguf",
        extra_tensors=[("dspark.0.attn_norm.weight", np.ones(TINY.hidden_size, np.float32), G.F32),
                       ("dspark.main_proj.weight", np.asarray(tiny.raw("blk.0.attn_kv.weight")), G.Q8_0),
                       # a type ds4c does not read, on a tensor it does not need
                       ("dspark.0.markov_w1.weight",
                        np.random.default_rng(1).integers(0, 256, (4, 144), dtype=np.uint8), G.Q4_K)],
        meta_set={"tokenizer.ggml.model": ("gpt2", "str"), "tokenizer.ggml.tokens": (tokens, "arr_str"),
                  "deepseek4.nextn_predict_layers": (1, "u32"), "deepseek4.rope.scaling.type": ("yarn", "str")})
    mf = open_model(p)
    assert mf.config == TINY
    assert mf.n_tensors == 178 + 3
    assert mf.weight_bytes_by_type()["Q4_K"] == (1, 4 * 144)
    assert mf.metadata["tokenizer.ggml.model"] == "gpt2"
    assert mf.metadata["tokenizer.ggml.tokens"] == tokens
    assert torch.equal(mf.tensor("blk.3.attn_kv.weight"), tiny.tensor("blk.3.attn_kv.weight"))
    assert "dspark.0.attn_norm.weight" not in mf.specs
    assert torch.equal(mf.tensor("dspark.0.attn_norm.weight"), torch.ones(TINY.hidden_size))
    assert mf.weight_bytes_by_type()["F32"][0] == tiny.weight_bytes_by_type()["F32"][0] + 1


def test_u32_ratio_array_and_u64_context_length_accepted(tmp_path, tiny):
    """Spec: compress_ratios may be an i32 or u32 array, context_length u64 or u32."""
    p = copy_model(tiny, tmp_path / "u32.gguf",
                   meta_set={"deepseek4.attention.compress_ratios": ([0, 0, 4, 16, 4, 16], "arr_u32"),
                             "deepseek4.context_length": (65536, "u64")})
    mf = open_model(p)
    assert mf.config == TINY
    assert mf.metadata["deepseek4.attention.compress_ratios"] == [0, 0, 4, 16, 4, 16]


def _open_fails(path: Path, *patterns: str) -> str:
    with pytest.raises(ModelFileError) as ei:
        open_model(path)
    msg = str(ei.value)
    assert str(path) in msg or path.name in msg, msg
    for pat in patterns:
        assert pat in msg, msg
    return msg


def test_wrong_architecture(tmp_path, tiny):
    p = copy_model(tiny, tmp_path / "llama.gguf", arch="llama")
    _open_fails(p, "general.architecture", "'deepseek4'", "'llama'")


def test_missing_metadata_key(tmp_path, tiny):
    p = copy_model(tiny, tmp_path / "nokey.gguf", meta_drop=("deepseek4.attention.indexer.top_k",))
    _open_fails(p, "deepseek4.attention.indexer.top_k", "missing")


def test_gating_func_not_sqrt_softplus(tmp_path, tiny):
    p = copy_model(tiny, tmp_path / "gating.gguf", meta_set={"deepseek4.expert_gating_func": (1, "u32")})
    _open_fails(p, "expert_gating_func")


@pytest.mark.parametrize("name", ["blk.4.indexer.proj.weight", "blk.1.ffn_gate_tid2eid.weight", "output.weight",
                                  "blk.3.exp_probs_b.bias"])
def test_missing_tensor(tmp_path, tiny, name):
    p = copy_model(tiny, tmp_path / "missing.gguf", drop=(name,))
    _open_fails(p, f"missing tensor {name!r}", str(list(tiny.specs[name].shape)))


def test_mis_shaped_tensor(tmp_path, tiny):
    name = "blk.2.attn_kv.weight"  # Q8_0 [192, 256]
    raw = np.asarray(tiny.raw(name))
    p = copy_model(tiny, tmp_path / "shape.gguf", replace={name: (raw[:-1], G.Q8_0)})
    _open_fails(p, repr(name), "[191, 256]", "[192, 256]")


def test_mis_shaped_f32_tensor(tmp_path, tiny):
    name = "blk.5.attn_sinks.weight"
    p = copy_model(tiny, tmp_path / "shape32.gguf", replace={name: (np.ones(5, np.float32), G.F32)})
    _open_fails(p, repr(name), "[5]", "[4]")


@pytest.mark.parametrize("name,data,t,found", [
    ("blk.1.attn_sinks.weight", lambda mf, n: bf16_bytes(mf.tensor(n)), G.BF16, "BF16"),  # F32 role as BF16
    ("blk.0.ffn_gate_tid2eid.weight", lambda mf, n: mf.tensor(n).float().numpy(), G.F32, "F32"),  # I32 as F32
    ("output.weight", lambda mf, n: quantize(mf.tensor(n), G.MXFP4).numpy(), G.MXFP4, "MXFP4"),  # BF16 role
    ("blk.3.attn_q_b.weight", lambda mf, n: quantize(mf.tensor(n), G.MXFP4).numpy(), G.MXFP4, "MXFP4"),  # FP8 role
])
def test_wrongly_typed_tensor(tmp_path, tiny, name, data, t, found):
    p = copy_model(tiny, tmp_path / "type.gguf", replace={name: (data(tiny, name), t)})
    role = tiny.specs[name].role
    allowed = ", ".join(x.name for x in ACCEPTED_TYPES[role])
    _open_fails(p, repr(name), f"type {found}", allowed, f"role {role}")


def test_pruned_experts_rejected(tmp_path, tiny):
    reps = {}
    for kind in ("gate", "up", "down"):
        name = f"blk.0.ffn_{kind}_exps.weight"
        reps[name] = (np.asarray(tiny.raw(name))[:12], G.MXFP4)
    p = copy_model(tiny, tmp_path / "pruned.gguf", replace=reps)
    msg = _open_fails(p, "'blk.0.ffn_gate_exps.weight'", "[12, 128, 256]", "[16, 128, 256]")
    assert "pruned" in msg


@pytest.mark.parametrize("cut", [1, 100, 70000])
def test_truncated_file(tmp_path, tiny_path, cut):
    data = tiny_path.read_bytes()
    p = tmp_path / "trunc.gguf"
    p.write_bytes(data[:-cut])
    _open_fails(p, "truncated")


@pytest.mark.parametrize("size", [5, 24, 100, 3000])
def test_truncated_inside_header(tmp_path, tiny_path, size):
    """Issue 28.8: a file cut inside its header says so, not numpy's "When changing to a larger dtype..."."""
    p = tmp_path / "head.gguf"
    p.write_bytes(tiny_path.read_bytes()[:size])
    msg = _open_fails(p, "truncated GGUF file", f"the file has {size} bytes")
    assert "dtype" not in msg and "index" not in msg and "Error" not in msg, msg


def test_vocabulary_mismatch_names_the_embedding_and_the_tokenizer(tmp_path, tiny):
    """Issue 28.8: a 500-row embedding with a 512-token tokenizer was reported as a bad tid2eid shape."""
    tokens = tiny.metadata["tokenizer.ggml.tokens"]
    emb = np.asarray(tiny.raw("token_embd.weight"))[:500]
    p = copy_model(tiny, tmp_path / "vocab.gguf",
                   replace={"token_embd.weight": (emb, tiny.ggml_type("token_embd.weight"))},
                   meta_set={"tokenizer.ggml.tokens": (tokens, "arr_str")})
    msg = _open_fails(p, "vocabulary mismatch", "token_embd.weight has 500 rows", "tokenizer", "512 tokens")
    assert "tid2eid" not in msg


@pytest.mark.parametrize("content,what", [(b"", "not a GGUF file"), (b"hello world\n", "not a GGUF file"),
                                          (b"GGUF", "truncated GGUF file"), ("random", "not a GGUF file")])
def test_not_a_gguf(tmp_path, content, what):
    p = tmp_path / "garbage.gguf"
    if content == "random":
        content = np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8).tobytes()
    p.write_bytes(content)
    _open_fails(p, what)


def test_nonexistent_path_and_directory(tmp_path):
    _open_fails(tmp_path / "nope.gguf", "no such model file")
    _open_fails(tmp_path, "found a directory")


def _write_legacy_copy(src: ModelFile, dst: Path) -> None:
    """``src`` rewritten the way ds4c 0.1 wrote files: bare HC base/scale names, BF16 norm gains, a
    ``deepseek4.vocab_size`` key, no ``general.file_type``."""
    from gguf import GGUFWriter

    from ds4c.config import to_gguf_metadata
    from ds4c.gguf_file import add_metadata_entries
    from ds4c.tensors import legacy_names

    new_to_old = {v: k for k, v in legacy_names(src.config).items()}
    w = GGUFWriter(str(dst), "deepseek4")
    add_metadata_entries(w, [e for e in to_gguf_metadata(src.config) if not e[0].endswith("embedding_length_out")])
    w.add_uint32("deepseek4.vocab_size", src.config.vocab_size)
    for name, spec in src.specs.items():
        if spec.role == ROLE_NORM:
            w.add_tensor(name, bf16_bytes(src.tensor(name)).reshape(spec.shape), raw_dtype=G.BF16)
        else:
            t = src._get(name)
            w.add_tensor(new_to_old.get(name, name), np.asarray(t.data), raw_dtype=src.ggml_type(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_files_of_ds4c_0_1_still_load(tmp_path, tiny):
    """ds4c 0.1 wrote bare HC base/scale names, BF16 norm gains and a vocab_size key: such a file opens with the
    same config and the same tensor values under the converter's names."""
    legacy = tmp_path / "legacy.gguf"
    _write_legacy_copy(tiny, legacy)
    mf = open_model(legacy)
    assert mf.config == tiny.config
    assert "blk.0.hc_attn_base" in mf.legacy_names and "output_hc_scale" in mf.legacy_names
    assert mf.ggml_type("blk.0.attn_norm.weight") == G.BF16 and tiny.ggml_type("blk.0.attn_norm.weight") == G.F32
    for name in ("blk.0.hc_attn_base.weight", "output_hc_scale.weight", "blk.3.attn_norm.weight", "output.weight"):
        assert torch.equal(mf.tensor(name), tiny.tensor(name)), name
    assert tiny.legacy_names == []


def test_written_layout_is_the_converters(tiny):
    """Names, types and keys as llama.cpp's converter writes them (conversion/deepseek.py): '.weight' on every
    HC base/scale, F32 1-D tensors, MOSTLY_MXFP4_MOE file type, embedding_length_out, no vocab_size key."""
    for name in tiny.specs:
        if name.startswith(("blk.", "output_hc")) and ("_base" in name or "_scale" in name):
            assert name.endswith(".weight"), name
        if len(tiny.specs[name].shape) == 1 and tiny.specs[name].role != ROLE_I32:
            assert tiny.ggml_type(name) == G.F32, name
    assert tiny.metadata["general.file_type"] == 38
    assert tiny.metadata["deepseek4.embedding_length_out"] == TINY.hidden_size * TINY.hc_mult
    assert "deepseek4.vocab_size" not in tiny.metadata


def test_synthetic_files_carry_a_tokenizer_in_the_converters_keys(tiny):
    from gguf import GGUFReader

    from ds4c.tokenizer import Tokenizer

    m = tiny.metadata
    assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.pre"] == "deepseek-v3"
    assert len(m["tokenizer.ggml.tokens"]) == TINY.vocab_size == len(m["tokenizer.ggml.token_type"])
    fields = GGUFReader(tiny.path).fields
    assert fields["tokenizer.ggml.token_type"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert fields["tokenizer.ggml.tokens"].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    tok = Tokenizer.from_metadata(m)
    ids = tok.encode("Hello, world! 你好 123456")
    assert tok.decode(ids, skip_special=True) == "Hello, world! 你好 123456"
    assert tok.bos_id == TINY.bos_id and tok.eos_id == TINY.eos_id and tok.chat_template


def test_fast_array_parsing_equals_gguf_reader(tmp_path):
    """_CheckedReader parses metadata arrays in one pass; every field equals what gguf's own reader builds
    (types, data indices, parts, contents), for string, int and float arrays (gguf writes no empty ones)."""
    from gguf import GGUFReader

    from ds4c.gguf_file import _CheckedReader, _field_value

    p = write_gguf(tmp_path / "arrays.gguf", [
        ("general.architecture", ARCH, "str"), ("t.strs", ["a", "", "ĠthÃ©", "<｜end▁of▁sentence｜>"] * 50, "arr_str"),
        ("t.i32", list(range(-5, 300)), "arr_i32"), ("t.u32", [0, 7, 2**32 - 1], "arr_u32"),
        ("t.f32", [0.5, -1.25, 3e-8], "arr_f32"), ("t.scalar", 7, "u32"),
        ("t.str", "hello", "str")], [("x", np.arange(8, dtype=np.float32), G.F32)])
    fast, ref = _CheckedReader(p), GGUFReader(p)
    assert list(fast.fields) == list(ref.fields)
    for k, f in fast.fields.items():
        g = ref.fields[k]
        assert f.types == g.types and f.data == g.data and len(f.parts) == len(g.parts), k
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(f.parts, g.parts)), k
        assert _field_value(f) == _field_value(g), k
    assert _field_value(fast.fields["t.strs"])[2] == "ĠthÃ©"
    assert np.array_equal(fast.tensors[0].data, np.arange(8, dtype=np.float32))
