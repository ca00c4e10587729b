"""Shared helpers for the export tests: run an exported step (the traced torch program or the MLIR module compiled
for the CPU) side by side with the IR interpreter over a run of positions, and compare every output.

Not a test module (no ``test_`` prefix); ``test_export_fx`` and ``test_export_mlir`` import it as ``export_check``,
and its fixtures ``tokens`` and ``fp32_weights``.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import pytest
import torch

from ds4c.config import Ds4Config, preset
from ds4c.sources import open_model
from ds4c.ir import Graph, Interpreter
from ds4c.ir.interpreter import state_to_inputs, step_inputs
from ds4c.reference import ReferenceWeights
from ds4c.reference import primitives as P
from ds4c.reference.state import SequenceState

N_POS = 40  # positions stepped: tiny's ring wraps at 16 and 32, CSA / indexer flush every 4 (10 compressed rows
#             > index_topk 8, so the indexer really chooses), HCA flushes at 15 and 31
MAX_CTX = 128
U32 = 2.0 ** -24  # fp32 unit roundoff
#: run every width, not only the default cases (see :func:`cases`)
ALL_WIDTHS = os.environ.get("DS4C_EXPORT_ALL_WIDTHS") == "1"


def cases(names: Sequence[str], default: Sequence[str]) -> list:
    """pytest parameters for ``names``; those not in ``default`` skip unless ``DS4C_EXPORT_ALL_WIDTHS=1``. The CI
    suite has a time budget (~12 min on 2 cores) and one export + CPU compile of tiny's step costs ~50 s of a core:
    the default cases are the narrowest and widest steps and a prefill chunk; the other widths build the same ops
    at other static sizes."""
    why = "runs with DS4C_EXPORT_ALL_WIDTHS=1 (the CI time budget; the default cases run the same lowerings)"
    return [n if n in default or ALL_WIDTHS else pytest.param(n, marks=pytest.mark.skip(reason=why)) for n in names]


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    """Fresh token ids of tiny for :data:`N_POS` positions and a chunk's worth more (never the pad id 0)."""
    g = torch.Generator().manual_seed(3401)
    return torch.randint(1, preset("tiny").vocab_size, (N_POS + 8,), generator=g).tolist()


@pytest.fixture(scope="module")
def fp32_weights(tiny_path) -> ReferenceWeights:
    """tiny's weights in the fp32 dataflow without quant emulation: the dataflow in which an exported step and the
    interpreter differ only by the order of fp32 operations."""
    w = ReferenceWeights.load(open_model(tiny_path), dataflow="fp32")
    w.config = w.config.replace(quant_emulation=False)
    return w


def fp32_reorder_bound(cfg: Ds4Config) -> float:
    """The relative error an fp32 step may show against the interpreter from the order of its operations alone.

    Both compute the same fp32 operations; only the order of the terms of each sum differs (torch's row-wise and
    batched GEMMs block differently; MLIR's loops sum in index order). Reordering a K-term fp32 sum moves it by at
    most gamma_K = K u / (1 - K u) of the sum of the terms' magnitudes (Higham, Accuracy and Stability, 3.1); the
    longest sum of the step is the HC mixing over hc_mult * hidden terms (1024 for tiny; every projection, the
    attention over <= 48 list entries and the head sum fewer), and the norms, softmaxes and Sinkhorn steps that
    follow do not amplify relative error. So gamma_{hc*D} bounds the norm-wise relative error of every output:
    6.1e-5 for tiny, ~100x the ~5e-7 observed, and 60x below one bf16 rounding (2^-9), the smallest error a
    wrong dtype, a dropped fake-quant or a flipped top-k choice would make.
    """
    k = cfg.hc_mult * cfg.hidden_size
    assert k >= max(cfg.hidden_size, cfg.q_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.moe_inter)
    return k * U32 / (1 - k * U32)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float | None) -> float:
    """Assert ``got`` equals ``want`` (``tol`` None: bit for bit) or is within relative error ``tol`` in norm, with
    the non-finite entries (the compressor's -inf scores) equal; return the relative error."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{name}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
    if tol is None:
        assert torch.equal(got, want), f"{name}: max diff {(got.double() - want.double()).abs().max().item():.3g}"
        return 0.0
    g, w = got.double(), want.double()
    fin = torch.isfinite(w)
    assert torch.equal(torch.isfinite(g), fin) and torch.equal(g[~fin], w[~fin]), f"{name}: non-finite entries differ"
    den = w[fin].norm().item()
    err = (g[fin] - w[fin]).norm().item() / den if den else (g[fin].abs().max().item() if fin.any() else 0.0)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    return err


def step_alongside(graph: Graph, weights: ReferenceWeights, step: Callable[..., Sequence[torch.Tensor]],
                   arg_names: Sequence[str], tokens: list[int], tol: float | None, n_pos: int = N_POS,
                   rows: Callable[[int], int] | None = None, seed: int = 0) -> dict[str, float]:
    """Step ``graph`` from position 0 to ``n_pos`` with the interpreter, calling ``step(*args)`` (``args``: the step
    inputs named ``arg_names``, in order) on the same inputs before each step; compare every output with
    :func:`compare`. ``rows(p)``: the tokens of the step at ``p`` (a prefill chunk: 1..C; default the width). A
    shard's ``hc_in`` is fresh N(0, 1) data each step. Returns the worst relative error by output name.

    The state starts reset (zero KV, -inf scores) and is the interpreter's after every step, so each step of
    ``step`` starts from the exact state and errors do not accumulate."""
    cfg = weights.config
    ip = Interpreter(graph, weights)
    width = graph.meta["width"]
    lay = graph.meta.get("layers")
    with P.dataflow(weights.dataflow):
        state = SequenceState.new(cfg, graph.meta["max_ctx"], layers=tuple(lay) if lay else None)
    gen = torch.Generator().manual_seed(seed)
    worst: dict[str, float] = {}
    p = 0
    while p + width <= n_pos:
        n = rows(p) if rows else width
        ins = step_inputs(graph, state, tokens[p:p + n], p)
        if "hc_in" in graph.inputs:
            t = graph.inputs["hc_in"].type
            ins["hc_in"] = torch.randn(*t.shape, generator=gen).to(P.DATAFLOWS[weights.dataflow])
        got = step(*[ins[k].clone() for k in arg_names])
        with torch.no_grad():
            want = ip.run(ins)
        assert len(got) == len(want)
        for (name, w), g in zip(want.items(), got):
            worst[name] = max(worst.get(name, 0.0), compare(f"p={p} {name}", g, w, tol))
        bufs = state_to_inputs(state)
        for name, w in want.items():
            if name in bufs:
                bufs[name].copy_(w)
        state.pos = p = p + n
    return worst
