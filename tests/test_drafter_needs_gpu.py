"""A drafter's needs resolved when the compiled engine opens (``ds4c.engine.resolve_needs``), on a CUDA GPU:
``Model(draft=...)`` builds the compiled step with the DSpark drafter's taps or the MTP drafter's final HC recording
(nobody names them), its default drafter gives the tokens of a Model opened with ``taps`` / ``record_hc`` by hand
and the drafter passed to ``generate``; the compiled step and its layer split satisfy the engine protocols
(ds4c/engine_protocol.py) at run time. Skipped without a GPU; the lead runs it on the device:

    pytest -q -m gpu tests/test_drafter_needs_gpu.py

The CPU side (the protocols, ``resolve_needs``, ``open_engine`` on a faked device) is tests/test_engine_protocol.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")]

PROMPT = [5, 17, 301, 42, 7, 99, 3, 250, 11, 64, 128, 9, 33, 77, 401, 2, 18, 260, 95, 44]


def test_the_mtp_drafter_opens_a_recording_step(tiny_path, tmp_path):
    from ds4c.api import Model
    from ds4c.config import preset
    from ds4c.drafters.mtp_synth import make_mtp
    from ds4c.engine_protocol import (ChunkedPrefill, CompiledEngine, DeviceGreedyVerify, DeviceLoop, GraphHost,
                                      PipelinedVerify)

    path = make_mtp(preset("tiny"), tmp_path / "tiny-mtp.gguf", seed=0)
    kw = dict(device="cuda", engine="compiled", max_ctx=64)
    m = Model(tiny_path, draft=f"mtp:{path}", **kw)
    ex = m.stepper
    assert ex.records_final_hc and ex.taps == () and ex.final_hc_ring is not None
    for proto in (CompiledEngine, GraphHost, DeviceLoop, DeviceGreedyVerify, PipelinedVerify, ChunkedPrefill):
        assert isinstance(ex, proto), proto.__name__
    own = m.generate(PROMPT, 12, ignore_eos=True, spec_width=3).result
    by_hand = Model(tiny_path, record_hc=True, **kw).generate(PROMPT, 12, ignore_eos=True, spec_width=3,
                                                               draft=f"mtp:{path}").result
    assert own.speculative["drafter"] == "mtp:tiny-mtp.gguf" and own.speculative["steps"] > 0
    assert own.tokens == by_hand.tokens and own.speculative["widths"] == by_hand.speculative["widths"]
    split = Model(tiny_path, layer_split="3,3", draft=f"mtp:{path}", **kw).stepper  # the last shard records
    assert split.records_final_hc and isinstance(split, CompiledEngine) and isinstance(split, DeviceLoop)
    assert not isinstance(split, GraphHost) and not isinstance(split, DeviceGreedyVerify)


def test_the_dspark_drafter_opens_a_tapped_step(tiny_path, tmp_path):
    from ds4c.api import Model
    from ds4c.drafters.dspark import DSparkDrafter
    from ds4c.drafters.dspark_synth import make_dspark
    from ds4c.errors import Ds4cError
    from ds4c.sources import open_model

    path = make_dspark(open_model(tiny_path), tmp_path / "d.gguf", seed=1)
    taps = DSparkDrafter(path).file.taps
    kw = dict(device="cuda", engine="compiled", max_ctx=64)
    m = Model(tiny_path, draft=path, **kw)
    assert m.stepper.taps == taps and m.stepper.tap_ring is not None and not m.stepper.records_final_hc
    own = m.generate(PROMPT, 12, ignore_eos=True, spec_width=3).result
    by_hand = Model(tiny_path, taps=taps, **kw).generate(PROMPT, 12, ignore_eos=True, spec_width=3,
                                                          draft=path).result
    assert own.speculative["steps"] > 0 and own.tokens == by_hand.tokens
    with pytest.raises(Ds4cError, match="the DSpark drafter runs on an unsplit target") as ei:
        Model(tiny_path, layer_split="3,3", draft=path, **kw)
    assert "\n" not in str(ei.value)
