"""Run any IR graph (before or after passes) op by op with the ops' torch implementations.

Every produced tensor is checked against its value's type: static dims must match exactly, symbolic dims
bind on first sight and must agree afterwards, dtypes must match. Fused ops run their bodies.

:func:`run_step` runs a step on a reference :class:`~ds4c.reference.state.SequenceState` (inputs taken
from it, updated buffers written back), so the interpreter can be compared with the reference directly.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ds4c.errors import StepError
from ds4c.ir.graph import Graph, Op, Sym, TensorType, Value
from ds4c.ir.ops import OPS, RunCtx
from ds4c.reference import primitives as P
from ds4c.reference.state import SequenceState
from ds4c.reference.weights import ReferenceWeights

_DT = {"bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64, "bool": torch.bool, "u8": torch.uint8}


class InterpreterError(StepError):
    """A tensor produced while interpreting does not match its IR type, or an input is missing."""


class Interpreter:
    """Runs ``graph`` with ``weights`` (the reference's dequantized weights, looked up by GGUF name).

    ``dataflow``: ``"bf16"`` (the spec: activations and state rounded to bf16) or ``"fp32"`` (the reference's
    fp32 dataflow: every ``bf16`` value of the graph but the weights (the bf16 embedding table) is held and
    computed as fp32, nothing is rounded to bf16;
    the state buffers are then fp32, as a reference :class:`~ds4c.reference.state.SequenceState` of that dataflow
    holds them). None: the weights' dataflow.

    Raises:
        InterpreterError: an unknown dataflow, or one the weights were not loaded for.
    """

    def __init__(self, graph: Graph, weights: ReferenceWeights, dataflow: str | None = None):
        self.graph = graph
        self.w = weights
        self.dataflow = weights.dataflow if dataflow is None else dataflow
        if self.dataflow not in P.DATAFLOWS:
            raise InterpreterError(f"dataflow must be one of {sorted(P.DATAFLOWS)}, found {self.dataflow!r}")
        if self.dataflow != weights.dataflow:
            raise InterpreterError(f"dataflow {self.dataflow!r} needs weights loaded with ReferenceWeights.load(..., "
                                   f"dataflow={self.dataflow!r}); these were loaded for {weights.dataflow!r}")
        self._dt = {**_DT, "bf16": P.DATAFLOWS[self.dataflow]}
        cfg = weights.config

        def weight(name: str) -> Any:
            if name.endswith(".experts"):
                return None  # routed experts are read by id through ctx.expert
            return weights.by_name[name]

        self.ctx = RunCtx(cfg, weight, lambda layer, e: weights.experts.get(layer, e), weights.embed.device)

    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the graph. ``inputs`` maps every graph input name to a tensor. Returns every graph output.

        Raises:
            InterpreterError: a missing input, a tensor whose shape/dtype contradicts its IR type, or an op
                that rejects its inputs (a live length past a bucket's capacity).
        """
        env: dict[Value, Any] = {}
        syms: dict[Sym, int] = {}
        for name, v in self.graph.inputs.items():
            if name not in inputs:
                raise InterpreterError(f"missing graph input {name!r} ({v.type})")
            env[v] = inputs[name]
            self._check(v, inputs[name], syms)
        with torch.no_grad(), P.dataflow(self.dataflow):
            for op in self.graph.ops:
                self._run(op, env, syms)
        return {k: env[v] for k, v in self.graph.outputs.items()}

    def _run(self, op: Op, env: dict[Value, Any], syms: dict[Sym, int]) -> None:
        if op.body is not None:
            for b in op.body:
                self._run(b, env, syms)
            return
        try:
            outs = OPS[op.kind].run(self.ctx, [env[v] for v in op.inputs], op.attrs)
        except ValueError as e:  # an op rejecting its inputs (e.g. a live length past the bucket capacity)
            raise InterpreterError(f"{op.kind} (layer {op.layer}): {e}") from e
        for v, t in zip(op.outputs, outs):
            self._check(v, t, syms, op)
            env[v] = t

    def _check(self, v: Value, t: Any, syms: dict[Sym, int], op: Op | None = None) -> None:
        ty: TensorType = v.type
        if ty.dtype == "handle":
            return
        where = f"{op.kind} (layer {op.layer})" if op else "input"
        want = (_DT if op is not None and op.kind == "param" else self._dt)[ty.dtype]  # weights keep their dtype
        if not isinstance(t, torch.Tensor) or t.dtype != want or t.dim() != len(ty.shape):
            found = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InterpreterError(f"{where}: value %{v.name} expected {ty}, found {found}")
        for d, n in zip(ty.shape, t.shape):
            if isinstance(d, Sym):
                if syms.setdefault(d, n) != n:
                    raise InterpreterError(f"{where}: %{v.name} binds {d}={n}, but {d}={syms[d]} elsewhere")
            elif d != n:
                raise InterpreterError(f"{where}: value %{v.name} expected {ty}, found {list(t.shape)}")


def state_to_inputs(state: SequenceState) -> dict[str, torch.Tensor]:
    """The state buffers of a reference sequence state under the graph input names ``l{i}.*``."""
    out: dict[str, torch.Tensor] = {}
    for i, ls in enumerate(state.layers, start=state.first):  # a shard's state starts at its first layer
        out[f"l{i}.ring"] = ls.ring
        if ls.comp is not None:
            out[f"l{i}.comp"] = ls.comp
            out[f"l{i}.comp_kv"], out[f"l{i}.comp_score"] = ls.comp_state.kv, ls.comp_state.score
        if ls.idx_keys is not None:
            out[f"l{i}.idx_keys"] = ls.idx_keys
            out[f"l{i}.idx_kv"], out[f"l{i}.idx_score"] = ls.idx_state.kv, ls.idx_state.score
    return out


#: the token id of a padded prefill row (any id in the vocabulary: the row is computed, never kept)
PAD_TOKEN = 0


def step_inputs(graph: Graph, state: SequenceState, tokens: list[int], pos: int) -> dict[str, torch.Tensor]:
    """All inputs of ``graph`` for a step: token ids, position, live lengths (``live_r{ratio}`` inputs
    added by ``pad_compressed_kv``: ``(pos + n) // ratio``) and the state buffers. A prefill chunk graph
    (input ``n_valid``) of C rows takes ``n = len(tokens) <= C`` tokens, padded with :data:`PAD_TOKEN`."""
    dev = state.layers[0].ring.device
    n = len(tokens)
    ids = list(tokens)
    ins: dict[str, torch.Tensor] = {}
    if "n_valid" in graph.inputs:
        c = graph.meta["width"]
        ids += [PAD_TOKEN] * (c - n)
        ins["n_valid"] = torch.tensor(n, dtype=torch.int64, device=dev)
    ins.update({"tokens": torch.tensor(ids, dtype=torch.int64, device=dev),
                "pos": torch.tensor(pos, dtype=torch.int64, device=dev)})
    for name in graph.inputs:
        if name.startswith("live_r"):
            ins[name] = live_length(pos, n, int(name[len("live_r"):]), dev)
    ins.update(state_to_inputs(state))
    return ins


def live_length(pos: int, n: int, ratio: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``live_r{ratio}`` input of a step of ``n`` real rows at ``pos``: ``(pos + n) // ratio`` (i64)."""
    return torch.tensor((pos + n) // ratio, dtype=torch.int64, device=device)


def run_step(interp: Interpreter, state: SequenceState, tokens: list[int], pos: int,
             tap_ring: torch.Tensor | None = None, final_hc_ring: torch.Tensor | None = None) -> torch.Tensor:
    """One step through the interpreter on a reference state: runs, writes the updated buffers back into
    ``state`` and advances ``state.pos`` by ``len(tokens)``. Returns fp32 logits [q, vocab]; of a prefill chunk
    graph (``build_step(prefill=True)``, 1..C tokens, padded), the next token's logits [1, vocab] (every row's,
    [C, vocab], with ``all_logits``).

    ``tap_ring``: the DSpark tap ring (bf16 ``[window, n_taps * hidden]``, ``ds4c.ir.builder.tap_ring_type``) of a
    graph built with ``taps``, updated in place (row ``t mod window`` = ``main_hidden(t)`` of each step row t);
    required exactly when the graph has the ``tap_ring`` input.

    ``final_hc_ring``: the final HC state ring (bf16 ``[window + MAX_WIDTH, hc, hidden]``,
    ``ds4c.ir.builder.final_hc_ring_type``; spec 7.5's ``X_main``) of a graph built with ``record_hc``, updated in
    place (row ``t mod (window + MAX_WIDTH)`` = the HC state after the last layer of each step row t); required
    exactly when the graph has the ``final_hc_ring`` input.

    Raises:
        StepError: ``pos`` is not the state's next position, or the token count is not the graph's width (a
            prefill chunk graph: not in 1..C); a graph with taps and no ``tap_ring`` or the reverse; likewise
            ``record_hc`` and ``final_hc_ring``.
    """
    width = interp.graph.meta.get("width")
    if pos != state.pos:
        raise StepError(f"step at position {pos}, but the state's next position is {state.pos}")
    if interp.graph.meta.get("prefill"):
        if width is not None and not 1 <= len(tokens) <= width:
            raise StepError(f"prefill chunk graph is for 1..{width} tokens, got {len(tokens)}")
    elif width is not None and len(tokens) != width:
        raise StepError(f"graph is for width {width}, got {len(tokens)} tokens")
    if pos + len(tokens) > state.max_ctx:
        raise StepError(f"positions {pos}..{pos + len(tokens) - 1} exceed the state's max_ctx={state.max_ctx}")
    vocab = interp.w.config.vocab_size
    bad = [t for t in tokens if not 0 <= int(t) < vocab]
    if bad:
        raise StepError(f"token ids must be in 0..{vocab - 1}, found {bad}")
    return run_split_step([interp], state, tokens, pos, tap_ring, final_hc_ring)


def run_split_step(interps: list[Interpreter], state: SequenceState, tokens: list[int], pos: int,
                   tap_ring: torch.Tensor | None = None, final_hc_ring: torch.Tensor | None = None) -> torch.Tensor:
    """One step through the graphs of a layer split's shards (``build_step(..., layers=...)``, in layer
    order) on a whole-model reference state: shard k's ``hc_out`` is shard k+1's ``hc_in``, each shard's
    updated state buffers are written back. With one unsplit graph this is :func:`run_step` (which checks
    the arguments). Returns the last shard's fp32 logits [q, vocab]. ``tap_ring``: as :func:`run_step`, shared by
    the shards (each writes the columns of its tap layers). ``final_hc_ring``: as :func:`run_step` (the last shard
    writes it).

    Raises:
        InterpreterError: a shard graph whose inputs the previous shard does not provide.
        StepError: ``tap_ring`` missing for a graph with taps, given when no graph has taps, or of the wrong type;
            likewise ``final_hc_ring`` for a graph built with ``record_hc``.
    """
    from ds4c.ir.builder import FINAL_HC_RING, TAP_RING

    rec = [ip.graph.inputs[FINAL_HC_RING].type for ip in interps if FINAL_HC_RING in ip.graph.inputs]
    if rec and final_hc_ring is None:
        raise StepError(f"the graph records the final HC state (build_step(..., record_hc=True)): expected a "
                        f"final_hc_ring {rec[0]}, found none")
    if final_hc_ring is not None and not rec:
        raise StepError("a final_hc_ring was given, but no graph records the final HC state "
                        "(build_step(..., record_hc=True))")
    if final_hc_ring is not None and (final_hc_ring.dtype != torch.bfloat16
                                      or tuple(final_hc_ring.shape) != tuple(rec[0].shape)):
        raise StepError(f"final_hc_ring: expected {rec[0]}, found {final_hc_ring.dtype} {list(final_hc_ring.shape)}")

    want = [ip.graph.inputs[TAP_RING].type for ip in interps if TAP_RING in ip.graph.inputs]
    if want and tap_ring is None:
        raise StepError(f"the graph records the DSpark taps (meta taps {interps[0].graph.meta.get('taps')}): "
                        f"expected a tap_ring {want[0]}, found none")
    if tap_ring is not None and not want:
        raise StepError("a tap_ring was given, but no graph records the DSpark taps (build_step(..., taps=...))")
    ins = step_inputs(interps[0].graph, state, tokens, pos)
    buffers = state_to_inputs(state)
    if tap_ring is not None:
        ins[TAP_RING] = buffers[TAP_RING] = tap_ring
    if final_hc_ring is not None:
        ins[FINAL_HC_RING] = buffers[FINAL_HC_RING] = final_hc_ring
    out: dict[str, torch.Tensor] = {}
    for ip in interps:
        if "hc_in" in ip.graph.inputs:
            if "hc_out" not in out:
                raise InterpreterError("a shard graph reads hc_in, but no earlier shard wrote hc_out")
            ins["hc_in"] = out["hc_out"]
        for name in ip.graph.inputs:
            if name.startswith("live_r") and name not in ins:
                ins[name] = live_length(pos, len(tokens), int(name[len("live_r"):]), ins["pos"].device)
        out = ip.run(ins)
        for name, t in out.items():
            if name in buffers:
                buffers[name].copy_(t)
    state.pos = pos + len(tokens)
    return out["logits"]


def run_lanes_step(interp: Interpreter, states: list[SequenceState], tokens: list[list[int]]) -> torch.Tensor:
    """One lanes step (``build_step(..., lanes=...)``) through the interpreter: lane j takes ``tokens[j]`` (its
    ``meta["lanes"][j]`` rows) at its state's next position; each state's updated buffers are written back and its
    position advanced. Returns fp32 logits [sum of rows, vocab] in lane order.

    Raises:
        StepError: not a lanes graph, a state or token count per lane that does not match it, one state given to
            two lanes, states of another max_ctx than the graph's, token ids that are not ints in the vocabulary, or
            positions past a state's max_ctx.
    """
    from ds4c.ir.builder import lane_state_name

    lanes = interp.graph.meta.get("lanes")
    if not lanes:
        raise StepError("run_lanes_step needs a lanes graph (build_step(..., lanes=...))")
    if len(states) != len(lanes) or len(tokens) != len(lanes) or \
            any(len(t) != n for t, n in zip(tokens, lanes)):
        raise StepError(f"the graph's lanes have rows {list(lanes)}; got {len(states)} states and token counts "
                        f"{[len(t) for t in tokens]}")
    vocab = interp.w.config.vocab_size
    bad = [t for ts in tokens for t in ts
           if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= int(t) < vocab]
    if bad:
        raise StepError(f"token ids must be ints in 0..{vocab - 1}, found {bad[:8]}")
    if len({id(s) for s in states}) != len(states):
        raise StepError("each lane needs its own sequence state; the same state was given to two lanes")
    want = interp.graph.meta.get("max_ctx")
    other = [s.max_ctx for s in states if s.max_ctx != want]
    if want is not None and other:
        raise StepError(f"the lanes graph holds states of max_ctx {want}; found states of max_ctx {other}")
    dev = states[0].layers[0].ring.device
    ins: dict[str, torch.Tensor] = {
        "tokens": torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64, device=dev),
        "positions": torch.tensor([s.pos + i for s, ts in zip(states, tokens) for i in range(len(ts))],
                                  dtype=torch.int64, device=dev)}
    buffers: dict[str, torch.Tensor] = {}
    for j, (s, ts) in enumerate(zip(states, tokens)):
        if s.pos + len(ts) > s.max_ctx:
            raise StepError(f"lane {j}: positions {s.pos}..{s.pos + len(ts) - 1} exceed its max_ctx={s.max_ctx}")
        ins[lane_state_name(j, "pos")] = torch.tensor(s.pos, dtype=torch.int64, device=dev)
        for name, t in state_to_inputs(s).items():
            buffers[lane_state_name(j, name)] = t
        for name in interp.graph.inputs:
            prefix = lane_state_name(j, "live_r")
            if name.startswith(prefix):
                ins[name] = live_length(s.pos, len(ts), int(name[len(prefix):]), dev)
    ins.update(buffers)
    out = interp.run(ins)
    for name, t in out.items():
        if name in buffers:
            buffers[name].copy_(t)
    for s, ts in zip(states, tokens):
        s.pos += len(ts)
    return out["logits"]
