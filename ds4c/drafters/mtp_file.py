"""Where an MTP (nextn) drafter's tensors come from (docs/model.md 7.5), in llama.cpp's layout.

llama.cpp's converter (``conversion/deepseek.py``, ``DeepseekV4Model``) writes the checkpoint's ``mtp.0`` only in its
``--mtp`` export, an **MTP-only** file of architecture ``deepseek4``:

* metadata: the target's keys with ``block_count`` = trunk layers + 1, ``compress_ratios`` one entry per block
  (the MTP block's 0), ``swiglu_clamp_*`` one per block, ``deepseek4.nextn_predict_layers`` = 1;
* the block ``blk.<n_layers>.*``: every tensor of a ratio-0, scored-routing target block, plus ``nextn.eh_proj``
  (``e_proj`` and ``h_proj`` concatenated along the input: ``[D, 2D]`` torch order, always Q8_0), ``nextn.enorm``,
  ``nextn.hnorm`` and ``nextn.shared_head_norm`` (the MTP's own ``norm``);
* root tensors: ``token_embd``, ``output_norm`` and ``output`` are the **trunk's** (``embed``, ``norm``, ``head`` kept);
  ``output_hc_{fn,base,scale}`` are the **MTP's own** ``mtp.0.hc_head_*`` (renamed to the root names; the trunk's
  ``hc_head_*`` are dropped).

llama.cpp's MTP graph (``src/models/deepseek4.cpp``, ``graph_mtp``) reads the block, ``nextn.embed_tokens`` /
``nextn.shared_head_head`` when present (else ``token_embd`` / ``output``), ``nextn.shared_head_norm`` (else
``output_norm``) and the file's root ``output_hc_*``. A target file that carries its own nextn block (the converter
writes none; ds4c reads them, :class:`ds4c.gguf_file.ModelFile`) has one set of root ``output_hc_*``, the trunk's:
the MTP block then uses those, as llama.cpp's graph does.

:func:`open_mtp` opens either source and checks it against the target: the trunk hyper-parameters equal (one line
naming the first that differs), one nextn block of compress ratio 0, and the embedding and head the target's (a few
rows compared: the drafter computes with the target's copies).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds4c.config import Ds4Config
from ds4c.errors import ModelFileError
from ds4c.gguf_file import ModelFile
from ds4c.sources import open_model

EH_PROJ, ENORM, HNORM, HEAD_NORM = "nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", \
    "nextn.shared_head_norm.weight"
EMBED_TOKENS, SHARED_HEAD = "nextn.embed_tokens.weight", "nextn.shared_head_head.weight"
SHARED_ROOTS = ("token_embd.weight", "output.weight")
"""Root tensors an MTP-only file holds as copies of the trunk's (the drafter uses the target's)."""


def block_config(target: Ds4Config) -> Ds4Config:
    """The config of the MTP block as a one-layer model: the target's with one layer of compress ratio 0 and scored
    routing (the block is ``blk.<n_layers>``, past the hash layers), window and everything else the target's."""
    return target.replace(n_layers=1, compress_ratios=(0,), n_hash_layers=0, name=f"{target.name}-mtp")


@dataclass
class MTPSource:
    """An opened MTP block: ``file`` (the model file holding it), ``block`` (its block id = the trunk's layer count),
    ``mtp_only`` (the file is the converter's ``--mtp`` export, its ``output_hc_*`` the MTP's own), ``label`` (how the
    ``--draft`` value named it)."""

    file: ModelFile
    block: int
    mtp_only: bool
    label: str

    def name(self, short: str) -> str:
        """The file's name of block tensor ``short`` (e.g. ``attn_kv.weight`` -> ``blk.<block>.attn_kv.weight``)."""
        return f"blk.{self.block}.{short}"

    def has(self, short: str) -> bool:
        """True when the block has the optional tensor ``short`` (``nextn.embed_tokens.weight``, ...)."""
        return self.name(short) in self.file.mtp_specs

    def check_target(self, target: Ds4Config, target_file: Any = None) -> None:
        """Check the block serves ``target`` (see the module docstring).

        Args:
            target: the target's config. target_file: the target's model file, whose ``token_embd`` / ``output``
                rows the source's are compared with (skipped when None or when the source is the target file).
        Raises:
            ModelFileError: one line: a trunk hyper-parameter that differs (the first, with both values), or an
                embedding / head row that differs from the target's.
        """
        mine, theirs = self.file.config.model_dict(), target.model_dict()
        for key in theirs:
            if key != "name" and mine.get(key) != theirs[key]:
                raise ModelFileError(f"{self.file.path}: the MTP block does not fit the target {target.name!r}: "
                                     f"expected {key} = {theirs[key]} (the target's), found {mine.get(key)}")
        if target_file is None or target_file is self.file:
            return
        V = target.vocab_size
        rows = sorted({0, V // 2, V - 1})
        for name in SHARED_ROOTS:
            if name not in self.file.specs:
                continue
            a = torch.cat([self.file.rows(name, r, r + 1) for r in rows])
            b = torch.cat([target_file.rows(name, r, r + 1) for r in rows])
            if not torch.equal(a, b):
                raise ModelFileError(f"{self.file.path}: {name} differs from the target's {target_file.path} (rows "
                                     f"{rows} compared): expected the MTP file of the target's checkpoint (an MTP "
                                     f"file of another model or seed?)")


def _mtp_block(mf: ModelFile, label: str) -> MTPSource:
    blocks = list(getattr(mf, "nextn_blocks", []))
    if len(blocks) != 1:
        raise ModelFileError(f"{mf.path}: expected one MTP (nextn) block, found {len(blocks)} "
                             f"({', '.join(f'blk.{b}' for b in blocks)}); llama.cpp's DeepSeek-V4 MTP graph runs one")
    b = blocks[0]
    ratios = mf.config.compress_ratios
    ratio = ratios[b] if b < len(ratios) else 0
    if ratio != 0:
        raise ModelFileError(f"{mf.path}: the MTP block blk.{b} has compress ratio {ratio}: expected 0 (a sliding-"
                             f"window block, spec 7.5)")
    return MTPSource(mf, b, bool(mf.mtp_only), label)


def mtp_of_target(target_file: ModelFile) -> MTPSource:
    """The target file's own MTP block (``--draft mtp``).

    Raises:
        ModelFileError: one line: the target holds no nextn block (or more than one, or one of ratio != 0).
    """
    if not getattr(target_file, "nextn_blocks", None):
        n = target_file.config.n_layers
        raise ModelFileError(f"--draft mtp: {target_file.path} holds no MTP (nextn) block (expected blk.{n}.nextn.* "
                             f"tensors and deepseek4.nextn_predict_layers = 1); llama.cpp's convert --mtp writes it "
                             f"to a separate file: give --draft mtp:PATH")
    return _mtp_block(target_file, "mtp")


def open_mtp(path: str | os.PathLike[str], target: Ds4Config | None = None, target_file: Any = None) -> MTPSource:
    """A separate file holding an MTP block (``--draft mtp:PATH``): the converter's ``--mtp`` export, or a model
    file with its own nextn block; checked against ``target`` when given (:meth:`MTPSource.check_target`).

    Raises:
        ModelFileError: one line: an unreadable or invalid file, one without (exactly one, ratio-0) nextn block, or
            one that does not fit the target.
    """
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ModelFileError(f"MTP drafter: expected a file path (str or os.PathLike), found "
                             f"{type(path).__name__} {path!r:.60}")
    p = Path(path)
    mf = open_model(p, allow_mtp_only=True)
    if not mf.nextn_blocks:
        raise ModelFileError(f"--draft mtp:{p}: expected a file with an MTP (nextn) block (llama.cpp's convert --mtp "
                             f"or ds4c make-model --drafter mtp), found none (no blk.{mf.config.n_layers}.nextn.* "
                             f"tensors)")
    src = _mtp_block(mf, f"mtp:{p.name}")
    if target is not None:
        src.check_target(target, target_file)
    return src
