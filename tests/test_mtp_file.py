"""MTP (nextn) blocks in a GGUF (issue: real files and text, part 1): the converter's ``--mtp`` export writes the
MTP block as ``blk.<n_layers>.*`` with ``nextn.*`` tensors and counts it in ``block_count``
(``deepseek4.nextn_predict_layers``). ds4c reads the trunk's config from such a file, validates and lists the
MTP tensors, refuses an MTP-only file as a model with one line, and ``ds4c info`` names the MTP tensors.

The files here are written from ds4c's own inventory (:func:`ds4c.tensors.nextn_tensor_specs`); the independent
check that the inventory matches llama.cpp's converter is tests/test_llama_layout.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ds4c.cli import main
from ds4c.config import preset, to_gguf_metadata
from ds4c.errors import ModelFileError
from ds4c.sources import open_model
from ds4c.quant import GGMLType
from ds4c.synth import producer
from ds4c.tensors import FORMATS, nextn_tensor_specs, root_tensor_specs, tensor_specs
from test_gguf import write_gguf

TINY = preset("tiny")
G = GGMLType


def _stored(spec, seed: int = 3) -> tuple[str, np.ndarray, GGMLType]:
    t = FORMATS["official"][spec.role]
    raw = np.concatenate([np.ascontiguousarray(c).reshape(-1).view(np.uint8) for c in producer(TINY, seed)(spec, t)])
    if t == G.F32:
        data = raw.view(np.float32).reshape(spec.shape)
    elif t == G.I32:
        data = raw.view(np.int32).reshape(spec.shape)
    else:
        data = raw.reshape(*spec.shape[:-1], -1)
    return spec.name, data, t


def _metadata(n_nextn: int) -> list:
    meta = []
    for k, v, kind in to_gguf_metadata(TINY):
        if k == "deepseek4.block_count":
            v += n_nextn
        elif k == "deepseek4.attention.compress_ratios":
            v = list(v) + [0] * n_nextn
        meta.append((k, v, kind))
    return meta + [("deepseek4.nextn_predict_layers", n_nextn, "u32")]


@pytest.fixture(scope="module")
def mtp_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mtp")
    nextn = nextn_tensor_specs(TINY, TINY.n_layers)
    files = {
        "merged": write_gguf(d / "merged.gguf", _metadata(1), [_stored(s) for s in tensor_specs(TINY) + nextn]),
        "only": write_gguf(d / "mtp-only.gguf", _metadata(1),
                           [_stored(s) for s in root_tensor_specs(TINY) + nextn]),
        # nextn_predict_layers set but no nextn.eh_proj in the last block: llama.cpp's loader then counts every
        # block as trunk, so does ds4c
        "no-eh": write_gguf(d / "no-eh.gguf", to_gguf_metadata(TINY) + [("deepseek4.nextn_predict_layers", 1, "u32")],
                            [_stored(s) for s in tensor_specs(TINY)]),
    }
    return files


def test_merged_file_reads_the_trunk_and_validates_the_mtp_block(mtp_files):
    mf = open_model(mtp_files["merged"])
    assert mf.config.n_layers == TINY.n_layers and mf.config.model_dict() == TINY.model_dict()
    assert mf.nextn_blocks == [TINY.n_layers] and not mf.mtp_only
    names = set(mf.mtp_specs)
    assert {f"blk.6.nextn.{k}.weight" for k in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
    assert "blk.6.attn_q_a.weight" in names and "blk.6.ffn_gate_exps.weight" in names
    assert mf.extra_tensors == []
    eh = mf.tensor("blk.6.nextn.eh_proj.weight")
    assert tuple(eh.shape) == (TINY.hidden_size, 2 * TINY.hidden_size) and mf.ggml_type(
        "blk.6.nextn.eh_proj.weight") == G.Q8_0
    assert float(eh.abs().max()) > 0
    assert tuple(mf.expert("blk.6.ffn_down_exps.weight", 3).shape) == (TINY.hidden_size, TINY.moe_inter)


def test_mtp_only_file_is_refused_as_a_model_in_one_line(mtp_files):
    with pytest.raises(ModelFileError) as ei:
        open_model(mtp_files["only"])
    msg = str(ei.value)
    assert "\n" not in msg and "MTP-only" in msg and "blk.6" in msg and "main model" in msg, msg
    mf = open_model(mtp_files["only"], allow_mtp_only=True)
    assert mf.mtp_only and mf.nextn_blocks == [6]
    assert set(mf.specs) == {s.name for s in root_tensor_specs(TINY)}


def test_nextn_key_without_eh_proj_is_ignored(mtp_files):
    mf = open_model(mtp_files["no-eh"])
    assert mf.nextn_blocks == [] and mf.mtp_specs == {} and mf.config.n_layers == TINY.n_layers


def test_mis_shaped_mtp_tensor_is_named(tmp_path):
    nextn = nextn_tensor_specs(TINY, TINY.n_layers)
    tensors = [_stored(s) for s in tensor_specs(TINY) + nextn]
    tensors = [(n, np.ones(TINY.hidden_size + 1, np.float32), G.F32) if n == "blk.6.nextn.enorm.weight"
               else (n, d, t) for n, d, t in tensors]
    p = write_gguf(tmp_path / "bad.gguf", _metadata(1), tensors)
    with pytest.raises(ModelFileError, match=r"blk\.6\.nextn\.enorm\.weight.*shape \[257\]"):
        open_model(p)


@pytest.mark.parametrize("value", [7, 9])
def test_nextn_count_out_of_range(tmp_path, value):
    meta = [(k, v, kind) for k, v, kind in _metadata(1) if k != "deepseek4.nextn_predict_layers"]
    p = write_gguf(tmp_path / "bad.gguf", meta + [("deepseek4.nextn_predict_layers", value, "u32")],
                   [_stored(s) for s in tensor_specs(TINY)])
    with pytest.raises(ModelFileError, match="nextn_predict_layers in 0..block_count-1"):
        open_model(p)


def test_info_lists_the_mtp_tensors(mtp_files):
    r = CliRunner().invoke(main, ["info", str(mtp_files["only"])])
    assert r.exit_code == 0, r.output
    assert "MTP-only file" in r.output and "blk.6 nextn" in r.output and "eh_proj Q8_0" in r.output, r.output
    assert "layers: none" in r.output
    r = CliRunner().invoke(main, ["info", str(mtp_files["merged"]), "--json"])
    rec = json.loads(r.output)
    assert rec["mtp"]["mtp_only"] is False
    (blk,) = rec["mtp"]["blocks"]
    assert blk["block"] == 6 and blk["nextn"] == {"eh_proj": "Q8_0", "enorm": "F32", "hnorm": "F32",
                                                  "shared_head_norm": "F32"}
    assert len(rec["layers"]) == TINY.n_layers
    r = CliRunner().invoke(main, ["generate", str(mtp_files["only"]), "--prompt-ids", "1,2", "--max-new-tokens", "1"])
    assert r.exit_code != 0 and "MTP-only" in r.output and "Traceback" not in r.output, r.output


def test_mtp_file_without_a_ratio_for_its_block_is_refused(tmp_path):
    meta = [(k, list(v)[:TINY.n_layers] if k == "deepseek4.attention.compress_ratios" else v, kind)
            for k, v, kind in _metadata(1)]
    p = write_gguf(tmp_path / "short.gguf", meta,
                   [_stored(s) for s in root_tensor_specs(TINY) + nextn_tensor_specs(TINY, TINY.n_layers)])
    with pytest.raises(ModelFileError, match=r"compress_ratios to have an entry per block including the 1 MTP block "
                                             r"\(7\), found 6"):
        open_model(p, allow_mtp_only=True)
