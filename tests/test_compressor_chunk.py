"""The prefill chunk's compressors parallel over the chunk's flushes (templates/compressor/compress_chunk.cu.j2,
``compressor.render_compressor_chunk``): on the CPU emulator, the flush and state launches leave the state and
every compressed row bit for bit as the row-serial kernel does, from a random state, at chunk starts inside a
group and on its boundary, with padded rows, and for ratio 4 (main and indexer in one launch), 16 and 128 (the
split pooling); rows no flush writes keep their poison."""

from __future__ import annotations

import pytest
import torch

from ds4c.runtime.families import compressor as C
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from emulators import launch_emu


def _specs(kind: str, q: int) -> list[C.CompressorSpec]:
    if kind == "csa":  # a CSA layer: main (overlapping, d 128) and indexer (d 64) compressors in one launch
        return [C.CompressorSpec(4, 128, False, True, 64, 64, q, valid=True),
                C.CompressorSpec(4, 64, True, True, 0, 32, q, valid=True)]
    ratio = {"hca16": 16, "hca128": 128}[kind]
    return [C.CompressorSpec(ratio, 128, False, True, 64, 64, q, valid=True)]


def _buffers(specs, pos: int, nv: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = specs[0].q
    b = {"pos": torch.tensor([pos]), "n_valid": torch.tensor([nv])}
    for k, s in enumerate(specs):
        w, cap = s.state_width, (pos + q) // s.ratio + 2
        b[f"v{k}"] = torch.randn(q, w, generator=g)
        b[f"g{k}"] = torch.randn(q, w, generator=g)
        b[f"ape{k}"] = torch.randn(s.ratio, w, generator=g) * 0.3
        b[f"norm{k}"] = torch.rand(s.d, generator=g) + 0.5
        b[f"kv{k}"] = torch.randn(s.state_slots, w, generator=g)
        b[f"score{k}"] = torch.randn(s.state_slots, w, generator=g)
        b[f"rows{k}"] = torch.randint(-2 ** 15, 2 ** 15, (cap, s.d), generator=g, dtype=torch.int16)  # poison
        b[f"freqs{k}"] = torch.rand(s.rope_dim // 2, generator=g) * 0.1
    return b


def _run(specs, bufs, tmp_path, chunk: bool) -> dict[str, torch.Tensor]:
    tgt = target("sm_90")
    args = C.arg_names(specs)
    if chunk:
        seq = [(src, la.grid, la.block, args) for src, la in
               zip(C.render_compressor_chunk(specs, tgt, "cc"), C.chunk_launch_shapes(specs))]
    else:
        la = C.launch_shape(specs)
        seq = [(C.render_compressor(specs, tgt, "cs"), la.grid, la.block, args)]
    return launch_emu.run(seq, bufs, tmp_path)


CASES = [  # kind, q, pos, n_valid
    ("csa", 64, 0, 64),      # from the sequence start: the first flush pools the initial slots 0-3
    ("csa", 64, 1001, 37),   # inside a group, padded rows
    ("csa", 64, 1003, 64),   # on a group's last row: the first row of the chunk flushes
    ("csa", 64, 6, 2),       # one flush
    ("csa", 64, 5, 1),       # no flush: the state only
    ("hca16", 64, 9, 60),
    ("hca128", 300, 100, 300),  # split pooling, 3 flushes, the first from 27 rows before the chunk
]


@pytest.mark.parametrize("kind,q,pos,nv", CASES)
def test_chunk_kernels_equal_the_serial_kernel(kind, q, pos, nv, tmp_path):
    why = launch_emu.host_unavailable()
    if why:
        pytest.skip(why)
    specs = _specs(kind, q)
    bufs = _buffers(specs, pos, nv, seed=pos + nv)
    want = _run(specs, bufs, tmp_path / "serial", chunk=False)
    got = _run(specs, bufs, tmp_path / "chunk", chunk=True)
    flushed = 0
    for k, s in enumerate(specs):
        for name in (f"kv{k}", f"score{k}", f"rows{k}"):
            assert torch.equal(got[name].view(torch.int32 if name[0] != "r" else torch.int16),
                               want[name].view(torch.int32 if name[0] != "r" else torch.int16)), name
        flushed += len([i for i in range(nv) if (pos + i + 1) % s.ratio == 0])
        assert not torch.equal(want[f"kv{k}"], bufs[f"kv{k}"])  # the state moved
    assert flushed == 0 or any(not torch.equal(want[f"rows{k}"], bufs[f"rows{k}"]) for k in range(len(specs)))


def test_chunk_kernels_refuse_decode_specs():
    s = C.CompressorSpec(4, 128, False, True, 64, 64, 5)
    with pytest.raises(RenderError, match="valid specs without undo"):
        C.render_compressor_chunk([s], target("sm_90"), "x")
    la = C.chunk_launch_shapes(_specs("csa", 2048))
    assert la[0].grid == (512, 2, 1) and la[1].grid == (2, 1, 1)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "gfx942", "gfx1151"])
def test_chunk_kernels_compile_without_spills(arch, tmp_path):
    """The official CSA pair (main d 512 + indexer d 128) and the HCA ratio-128 compressor at C = 2048 compile for
    CUDA and HIP with no spills or scratch."""
    from kernel_compile import assert_no_spills, compile_kernel

    csa = [C.CompressorSpec(4, 512, False, True, 448, 64, 2048, valid=True),
           C.CompressorSpec(4, 128, True, True, 0, 64, 2048, valid=True)]
    hca = [C.CompressorSpec(128, 512, False, True, 448, 64, 2048, valid=True)]
    for n, specs in (("csa", csa), ("hca", hca)):
        for src in C.render_compressor_chunk(specs, target(arch), f"cc_{n}"):
            (tmp_path / src.entry).mkdir()
            c = compile_kernel(src, tmp_path / src.entry)
            assert_no_spills(c.usage, src, c.log)
