"""Build the IR of one decode (q = 1) or verify (q = 2..5) step of a DeepSeek-V4-Flash config.

The graph follows docs/model.md section 5 at the granularity of its sub-blocks: HC mixing logits,
Sinkhorn, pre-mix, RMSNorm, each projection (with its numeric mode), per-head RMS, RoPE, KV fake-quant,
compressor update and flush, indexer scores and top-k, sparse attention with sink, inverse RoPE, grouped
``wo_a``, HC post, router, experts, HC head. State buffers are explicit graph inputs (``l{i}.ring``,
``l{i}.comp``, ``l{i}.comp_kv``, ``l{i}.comp_score``, ``l{i}.idx_keys``, ``l{i}.idx_kv``, ``l{i}.idx_score``)
and their updated values are graph outputs of the same names; ``logits`` is the other output.

The width is the symbol ``q`` until the ``fix_verify_width`` pass specialises it to ``meta["width"]``.
"""

from __future__ import annotations

import numbers
from typing import Any

from ds4c.config import MAX_PREFILL_ROWS, MAX_WIDTH, Ds4Config
from ds4c.errors import StepError
from ds4c.ir.graph import Graph, Op, Sym, TensorType, Value
from ds4c.ir.ops import OPS, infer_op
from ds4c.tensors import tensor_specs

Q = Sym("q")


def span_sym(ratio: int) -> str:
    """Name of the live compressed-row span of a ratio: ``n_r4``, ``n_r128``."""
    return f"n_r{ratio}"


TAP_RING = "tap_ring"
"""The graph input and output name of the DSpark tap ring (spec 5.2(q); :func:`build_step` ``taps``)."""


def check_taps(cfg: Ds4Config, taps: Any) -> tuple[int, ...]:
    """``taps`` as a tuple of layer ids: the layers after which the DSpark taps are recorded (spec 5.2(q);
    official ``(40, 41, 42)``, in the drafter file's order: ``main_hidden`` concatenates them in this order).

    Raises:
        StepError: not distinct ints in ``0..n_layers-1``.
    """
    try:
        out = tuple(taps)
    except TypeError:
        out = None
    if out is None or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < cfg.n_layers
                          for t in out) or len(set(out)) != len(out):
        raise StepError(f"taps: expected distinct layer ids in 0..{cfg.n_layers - 1}, found {taps!r}")
    return tuple(int(t) for t in out)


def tap_ring_type(cfg: Ds4Config, n_taps: int) -> TensorType:
    """The DSpark tap ring: bf16 ``[window, n_taps * hidden]``; row ``t mod window`` holds ``main_hidden(t)``
    (spec 5.2(q)) of the last position t written there."""
    return TensorType((cfg.window, n_taps * cfg.hidden_size), "bf16")


FINAL_HC_RING = "final_hc_ring"
"""The graph input and output name of the final HC state ring (spec 7.5's ``X_main``; :func:`build_step`
``record_hc``)."""


def final_hc_ring_type(cfg: Ds4Config) -> TensorType:
    """The final HC state ring: bf16 ``[window + MAX_WIDTH, hc_mult, hidden]``; row ``t mod (window + MAX_WIDTH)``
    holds ``X_main(t)`` (the HC streams after the last layer, before the HC head; spec 5.4.1's input, 7.5) of the
    last position t written there. A verify step writes at most ``MAX_WIDTH`` rows past the committed ones, so the
    newest ``window`` committed positions stay in the ring after any rollback (as the reference's
    ``final_hc_rows``)."""
    return TensorType((cfg.window + MAX_WIDTH, cfg.hc_mult, cfg.hidden_size), "bf16")


def state_inputs(cfg: Ds4Config, max_ctx: int, layers: tuple[int, int] | None = None) -> dict[str, TensorType]:
    """The state buffers of the step (spec section 4), name -> type; of layers ``[start, stop)`` only when
    ``layers`` is given (a shard of a layer split)."""
    out: dict[str, TensorType] = {}
    start, stop = layers or (0, cfg.n_layers)
    for i in range(start, stop):
        r = cfg.ratio(i)
        out[f"l{i}.ring"] = TensorType((cfg.window, cfg.head_dim), "bf16")
        if r:
            c = 2 if r == 4 else 1
            slots = 8 if r == 4 else r
            out[f"l{i}.comp"] = TensorType((max(max_ctx // r, 1), cfg.head_dim), "bf16")
            out[f"l{i}.comp_kv"] = TensorType((slots, c * cfg.head_dim), "f32")
            out[f"l{i}.comp_score"] = TensorType((slots, c * cfg.head_dim), "f32")
        if r == 4:
            out[f"l{i}.idx_keys"] = TensorType((max(max_ctx // 4, 1), cfg.index_head_dim), "bf16")
            out[f"l{i}.idx_kv"] = TensorType((8, 2 * cfg.index_head_dim), "f32")
            out[f"l{i}.idx_score"] = TensorType((8, 2 * cfg.index_head_dim), "f32")
    return out


class GraphBuilder:
    """Appends ops with inferred output types; ``layer`` tags every op added."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.layer = -1
        self._params: dict[str, Value] = {}

    def op(self, op_kind: str, *ins: Value, name: str = "", **attrs: Any) -> Any:
        kind = op_kind
        types = infer_op(kind, [v.type for v in ins], attrs)
        names = OPS[kind].outputs
        outs = [Value(t, name if len(types) == 1 else f"{name}.{names[k]}") for k, t in enumerate(types)]
        op = Op(kind, list(ins), outs, attrs, self.layer)
        for v in outs:
            v.producer = op
        self.ops.append(op)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def param(self, name: str, shape: tuple[int, ...], dtype: str = "f32") -> Value:
        return self.op("param", name=name, weight=name, shape=tuple(shape), dtype=dtype)


MAX_LANE_ROWS = 16
"""The most rows of a lanes step (all lanes together; issue 30's row budget)."""


def check_lanes(lanes: Any) -> tuple[int, ...]:
    """``lanes`` as a tuple of per-lane row counts: each 1..MAX_WIDTH, at most MAX_LANE_ROWS in all.

    Raises:
        StepError: anything else (one line naming what was found).
    """
    try:
        out = tuple(lanes) if not isinstance(lanes, (str, bytes)) else None
    except TypeError:
        out = None
    if out is not None and len(out) > MAX_LANE_ROWS:
        raise StepError(f"lanes: at most {MAX_LANE_ROWS} lanes of 1..{MAX_WIDTH} rows, found {len(out)} lanes")
    if not out or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= MAX_WIDTH
                      for n in out) or sum(out) > MAX_LANE_ROWS:
        raise StepError(f"lanes: expected row counts in 1..{MAX_WIDTH}, at most {MAX_LANE_ROWS} rows in all, "
                        f"found {lanes!r}")
    return tuple(int(n) for n in out)


def lane_state_name(lane: int, name: str) -> str:
    """The graph input / output name of lane ``lane``'s state buffer ``name`` (``l{i}.ring`` ...) in a lanes step."""
    return f"lane{lane}.{name}"


def check_layers(cfg: Ds4Config, layers: tuple[int, int] | None) -> tuple[int, int]:
    """``layers`` as ``(start, stop)`` (the whole model when None).

    Raises:
        StepError: not a non-empty range inside ``0..n_layers``.
    """
    if layers is None:
        return 0, cfg.n_layers
    start, stop = (int(v) for v in layers)
    if not 0 <= start < stop <= cfg.n_layers:
        raise StepError(f"layer range [{start},{stop}): expected 0 <= start < stop <= {cfg.n_layers}")
    return start, stop


def build_step(cfg: Ds4Config, width: int, max_ctx: int = 4096, layers: tuple[int, int] | None = None,
               prefill: bool = False, all_logits: bool = False, taps: tuple[int, ...] = (),
               record_hc: bool = False, lanes: tuple[int, ...] | None = None) -> Graph:
    """The IR of one step of ``width`` rows (1 = decode, 2..5 = verify; with ``prefill`` a chunk of a prompt)
    for ``cfg``.

    Args:
        cfg: the model config (``quant_emulation`` decides the fake-quant attributes).
        width: q, recorded in ``meta["width"]`` (shapes carry the symbol ``q`` until ``fix_verify_width``).
        max_ctx: positions the state buffers hold (compressed-row capacities are ``max_ctx // ratio``).
        layers: ``(start, stop)``: the graph of one shard of a layer split (``ds4c.shard_plan``): layers
            ``start..stop-1`` only. A shard that does not start at layer 0 reads the incoming HC state from the
            input ``hc_in`` (bf16 ``[q, hc_mult, hidden]``) instead of embedding the tokens; one that does not
            end at the last layer writes its outgoing HC state to the output ``hc_out`` (same type) instead of
            the head's ``logits``. ``tokens`` and ``pos`` are inputs of every shard (hash routing reads the
            token ids). Recorded in ``meta["layers"]``.
        prefill: a prefill chunk graph of ``width`` = C rows (1..``MAX_PREFILL_ROWS``; docs/prefill.md):
            the same ops, plus the input ``n_valid`` (i64 scalar, 1..C): rows ``n_valid..C-1`` are padding
            (the last chunk of a prompt, padded to a compiled size), computed but never written to the window
            ring, the compressor / indexer state or the spans the valid rows see. The head reads only row
            ``n_valid - 1`` (``take_row``): ``logits`` is fp32 [1, vocab] (the next token's). Recorded in
            ``meta["prefill"]``.
        all_logits: with ``prefill``, the head reads every row instead: ``logits`` [C, vocab] (rows past
            ``n_valid`` meaningless).
        taps: the DSpark tap layers (spec 5.2(q); :func:`check_taps`), all of them in ``main_hidden`` order, also
            for a shard. When some are in the graph's layers, the graph has the input and output
            :data:`TAP_RING` (:func:`tap_ring_type`, updated in place like the state buffers) and one
            ``dspark_tap`` op after the last of them, writing for each step row at position t the bf16 mean
            over the HC streams of each local tap layer's output into ring row ``t mod window``, columns of
            its index in ``taps``; recorded in ``meta["taps"]``. Empty (the default): no tap op, the graph is
            unchanged.
        record_hc: record the final HC state (spec 7.5's ``X_main``, the MTP drafter's input) of every step row:
            in a graph that holds the last layer (the whole model, or a split's last shard; a graph without it
            ignores the option), the input and output :data:`FINAL_HC_RING` (:func:`final_hc_ring_type`,
            updated in place) and one ``record_hc`` op after the last layer, before the head, copying each row's
            streams (bf16 ``[hc, hidden]``) into ring row ``t mod (window + MAX_WIDTH)`` (a padded prefill
            chunk's padding rows are not written); recorded in ``meta["record_hc"]``. False (the default): the
            graph is unchanged.
        lanes: a lanes step (docs/batching.md): the rows of several sequences, ``lanes[j]`` rows (1 decode, 2..5
            verify) of lane j, ``width == sum(lanes)`` rows in lane order, at most :data:`MAX_LANE_ROWS`. Row-wise
            work (HC, projections, experts, head) runs over all rows; each lane has its own state inputs
            (:func:`lane_state_name`: ``lane{j}.l{i}.ring`` ...), position ``lane{j}.pos`` and its rows'
            compressor, indexer, attention and ring write (``lane_rows`` views of the row-wise values;
            ``concat_rows`` joins the attention outputs). Row positions are the input ``positions`` (i64
            [width]) instead of ``pos + i``. Types are static from the start. Not with ``prefill``, ``layers``,
            ``taps`` or ``record_hc``. Recorded in ``meta["lanes"]``.

    Raises:
        StepError: width outside 1..5 (1..MAX_PREFILL_ROWS with ``prefill``), max_ctx < 1, a layer range
            outside the model, ``all_logits`` without ``prefill``, or taps that are not distinct layer ids; lanes
            that are not 1..MAX_LANE_ROWS rows in all of 1..5 rows each summing to ``width``, or lanes with an
            option they do not take.
    """
    if lanes is not None:
        lanes = check_lanes(lanes)
        if (prefill, layers, tuple(taps), record_hc) != (False, None, (), False):
            raise StepError("a lanes step takes no prefill, layers, taps or record_hc")
        if width != sum(lanes):
            raise StepError(f"a lanes step of lanes {list(lanes)} has width {sum(lanes)}, found {width}")
    limit = MAX_PREFILL_ROWS if prefill else MAX_LANE_ROWS if lanes is not None else MAX_WIDTH
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= limit:
        raise StepError(f"{'prefill chunk' if prefill else 'step'} width must be in 1..{limit}, found {width}")
    if all_logits and not prefill:
        raise StepError("all_logits is a prefill graph option (a decode / verify step has the logits of every row)")
    if max_ctx < 1:
        raise StepError(f"max_ctx must be >= 1, found {max_ctx}")
    start, stop = check_layers(cfg, layers)
    taps = check_taps(cfg, taps)
    local = {l: j for j, l in enumerate(taps) if start <= l < stop}  # tap layer -> its slot in main_hidden
    b = GraphBuilder()
    shapes = {s.name: s.shape for s in tensor_specs(cfg)}

    def W(name: str, dtype: str = "f32") -> Value:
        return b.param(name, shapes[name], dtype)

    rows_dim = width if lanes is not None else Q
    inputs: dict[str, Value] = {"tokens": Value(TensorType((rows_dim,), "i64"), "tokens")}
    spans = [(0, width)] if lanes is None else [(sum(lanes[:j]), n) for j, n in enumerate(lanes)]
    prefixes = [""] if lanes is None else [f"lane{j}." for j in range(len(lanes))]
    for pre in prefixes:
        inputs[pre + "pos"] = Value(TensorType((), "i64"), pre + "pos")
    for pre in prefixes:
        for k, t in state_inputs(cfg, max_ctx, (start, stop)).items():
            inputs[pre + k] = Value(t, pre + k)
    outputs: dict[str, Value] = {}
    tok = inputs["tokens"]
    valid: tuple[Value, ...] = ()  # the padded chunk's n_valid, passed to every op that writes state
    if prefill:
        valid = (inputs.setdefault("n_valid", Value(TensorType((), "i64"), "n_valid")),)
    if local:
        inputs[TAP_RING] = Value(tap_ring_type(cfg, len(taps)), TAP_RING)
    record_hc = bool(record_hc) and stop == cfg.n_layers
    if record_hc:
        inputs[FINAL_HC_RING] = Value(final_hc_ring_type(cfg), FINAL_HC_RING)
    tapped: list[Value] = []  # the outputs of the local tap layers, in layer order
    emu, eps, hc = cfg.quant_emulation, cfg.norm_eps, cfg.hc_mult
    if lanes is None:
        positions = b.op("row_positions", tok, inputs["pos"], name="positions")
    else:
        positions = inputs["positions"] = Value(TensorType((width,), "i64"), "positions")
    views: dict[tuple[Value, int], Value] = {}

    def lane(v: Value, j: int) -> Value:
        """Lane j's rows of a row-wise value (the value itself in a one-sequence step)."""
        if lanes is None:
            return v
        if (v, j) not in views:
            views[v, j] = b.op("lane_rows", v, start=spans[j][0], rows=spans[j][1], name=f"{v.name}.lane{j}")
        return views[v, j]

    def st(j: int, name: str) -> Value:
        return inputs[prefixes[j] + name]
    freq_attrs = dict(rope_dim=cfg.rope_dim, factor=cfg.rope_factor, orig_len=cfg.original_seq_len,
                      beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow)

    if start == 0:
        e = b.op("embed", tok, W("token_embd.weight", "bf16"), name="embed")
        x = b.op("hc_expand", e, hc=hc, name="x0")
    else:
        x = inputs["hc_in"] = Value(TensorType((Q, hc, cfg.hidden_size), "bf16"), "hc_in")

    def hc_pre(x: Value, sub: str, norm: str, tag: str) -> tuple[Value, Value, Value]:
        p = f"blk.{b.layer}."
        m = b.op("hc_mix", x, W(p + f"hc_{sub}_fn.weight"), eps=eps, name=f"{tag}.mix")
        pre, post, comb = b.op("sinkhorn", m, W(p + f"hc_{sub}_scale.weight"), W(p + f"hc_{sub}_base.weight"), hc=hc,
                               iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, name=f"{tag}.hc")
        y = b.op("hc_premix", x, pre, name=f"{tag}.y")
        return b.op("rms_norm", y, W(p + norm), eps=eps, name=f"{tag}.normed"), post, comb

    for i in range(start, stop):
        b.layer = i
        p, L = f"blk.{i}.", f"l{i}"
        r = cfg.ratio(i)
        yarn = cfg.uses_yarn(i)
        freqs = b.op("rope_freqs", base=cfg.rope_base(i), yarn=yarn, name="freqs_yarn" if yarn else "freqs",
                     **freq_attrs)
        # ---- attention sub-block
        a, post, comb = hc_pre(x, "attn", "attn_norm.weight", f"{L}.attn")
        qa = b.op("linear", a, W(p + "attn_q_a.weight"), mode="fp8act", act_quant=emu, name=f"{L}.qa")
        qr = b.op("rms_norm", qa, W(p + "attn_q_a_norm.weight"), eps=eps, name=f"{L}.qr")
        qf = b.op("linear", qr, W(p + "attn_q_b.weight"), mode="fp8act", act_quant=emu, name=f"{L}.qb")
        qh = b.op("reshape", qf, tail=(cfg.n_heads, cfg.head_dim), name=f"{L}.qh")
        qh = b.op("head_rms", qh, eps=eps, name=f"{L}.qh_rms")
        qh = b.op("rope", qh, positions, freqs, inverse=False, name=f"{L}.q")
        kv = b.op("linear", a, W(p + "attn_kv.weight"), mode="fp8act", act_quant=emu, name=f"{L}.kv_proj")
        kv = b.op("rms_norm", kv, W(p + "attn_kv_a_norm.weight"), eps=eps, name=f"{L}.kv_normed")
        kv = b.op("rope", kv, positions, freqs, inverse=False, name=f"{L}.kv_rope")
        kv = b.op("kv_fake_quant", kv, nope=cfg.nope_dim, enabled=emu, name=f"{L}.kv")
        comp_span: dict[int, Value] = {}
        mask: dict[int, Value] = {}
        sel: dict[int, Value] = {}
        if r:
            d = cfg.head_dim
            if r == 4:  # indexer query, head weights, indexer compressor (spec 5.2(f))
                qi = b.op("linear", qr, W(p + "indexer.attn_q_b.weight"), mode="fp8act", act_quant=emu,
                          name=f"{L}.qi_proj")
                qi = b.op("reshape", qi, tail=(cfg.index_n_heads, cfg.index_head_dim), name=f"{L}.qi_heads")
                qi = b.op("rope", qi, positions, freqs, inverse=False, name=f"{L}.qi_rope")
                qi = b.op("hadamard", qi, name=f"{L}.qi_rot")
                if emu:
                    qi = b.op("fp4_fake_quant", qi, block=32, name=f"{L}.qi")
                hw = b.op("linear", a, W(p + "indexer.proj.weight"), mode="bf16", name=f"{L}.hw_proj")
                hw = b.op("mul_scalar", hw, value=cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5,
                          name=f"{L}.hw")
                iv = b.op("linear", a, W(p + "indexer_compressor_kv.weight"), mode="f32", name=f"{L}.idx_v")
                ig = b.op("linear", a, W(p + "indexer_compressor_gate.weight"), mode="f32", name=f"{L}.idx_g")
                for j, pre in enumerate(prefixes):
                    n = f"{pre}{L}"
                    ikv, isc, keys = b.op(
                        "compress", lane(iv, j), lane(ig, j), W(p + "indexer_compressor_ape.weight"),
                        W(p + "indexer_compressor_norm.weight"), st(j, f"{L}.idx_kv"), st(j, f"{L}.idx_score"),
                        st(j, f"{L}.idx_keys"), lane(positions, j), freqs, *valid, ratio=4, d=cfg.index_head_dim,
                        indexer=True, emulate=emu, nope=cfg.index_head_dim - cfg.rope_dim, eps=eps, name=f"{n}.idx")
                    outputs.update({f"{n}.idx_kv": ikv, f"{n}.idx_score": isc, f"{n}.idx_keys": keys})
                    key_span = b.op("live_rows", keys, lane(tok, j), st(j, "pos"), *valid, ratio=4,
                                    sym=pre + span_sym(4), name=f"{n}.key_span")
                    key_mask = b.op("span_mask", key_span, lane(positions, j), ratio=4, name=f"{n}.key_mask")
                    sel[j] = b.op("indexer_topk", lane(qi, j), key_span, lane(hw, j), key_mask, topk=cfg.index_topk,
                                  name=f"{n}.sel")
            v = b.op("linear", a, W(p + "attn_compressor_kv.weight"), mode="f32", name=f"{L}.comp_v")
            g = b.op("linear", a, W(p + "attn_compressor_gate.weight"), mode="f32", name=f"{L}.comp_g")
            for j, pre in enumerate(prefixes):
                n = f"{pre}{L}"
                ckv, csc, rows = b.op(
                    "compress", lane(v, j), lane(g, j), W(p + "attn_compressor_ape.weight"),
                    W(p + "attn_compressor_norm.weight"), st(j, f"{L}.comp_kv"), st(j, f"{L}.comp_score"),
                    st(j, f"{L}.comp"), lane(positions, j), freqs, *valid, ratio=r, d=d, indexer=False, emulate=emu,
                    nope=cfg.nope_dim, eps=eps, name=f"{n}.comp")
                outputs.update({f"{n}.comp_kv": ckv, f"{n}.comp_score": csc, f"{n}.comp": rows})
                comp_span[j] = b.op("live_rows", rows, lane(tok, j), st(j, "pos"), *valid, ratio=r,
                                    sym=pre + span_sym(r), name=f"{n}.comp_span")
                if r != 4:
                    mask[j] = b.op("span_mask", comp_span[j], lane(positions, j), ratio=r, name=f"{n}.comp_mask")
        kind = cfg.layer_kind(i)
        o_lanes = []
        for j, pre in enumerate(prefixes):
            extra = () if kind == "swa" else (comp_span[j], sel[j] if kind == "csa" else mask[j])
            o_lanes.append(b.op("sparse_attention", lane(qh, j), st(j, f"{L}.ring"), lane(kv, j), lane(positions, j),
                                W(p + "attn_sinks.weight"), *extra, kind=kind, window=cfg.window,
                                scale=cfg.head_dim ** -0.5, name=f"{pre}{L}.o"))
        o = o_lanes[0] if lanes is None else b.op("concat_rows", *o_lanes, name=f"{L}.o")
        for j, pre in enumerate(prefixes):
            outputs[f"{pre}{L}.ring"] = b.op("ring_write", st(j, f"{L}.ring"), lane(kv, j), lane(positions, j), *valid,
                                             window=cfg.window, name=f"{pre}{L}.ring_new")
        o = b.op("rope", o, positions, freqs, inverse=True, name=f"{L}.o_rope")
        z = b.op("grouped_linear", o, W(p + "attn_output_a.weight"), groups=cfg.o_groups, name=f"{L}.z")
        z = b.op("reshape", z, tail=(cfg.o_groups * cfg.o_lora_rank,), name=f"{L}.z_flat")
        out = b.op("linear", z, W(p + "attn_output_b.weight"), mode="fp8act", act_quant=emu, name=f"{L}.attn_out")
        x = b.op("hc_post", out, x, post, comb, name=f"{L}.x_attn")
        # ---- MoE sub-block
        bn, post, comb = hc_pre(x, "ffn", "ffn_norm.weight", f"{L}.ffn")
        zr = b.op("linear", bn, W(p + "ffn_gate_inp.weight"), mode="f32", name=f"{L}.router_logits")
        s = b.op("router_scores", zr, name=f"{L}.router_scores")
        table = W(p + "ffn_gate_tid2eid.weight", "i64") if cfg.is_hash_layer(i) else W(p + "exp_probs_b.bias")
        ids, wts = b.op("route", s, tok, table, k=cfg.n_active_experts, scale=cfg.route_scale,
                        hash=cfg.is_hash_layer(i), name=f"{L}.route")
        bank = b.param(f"blk.{i}.experts", (cfg.n_experts,), "handle")
        routed = b.op("routed_experts", bn, ids, wts, bank, layer=i, limit=cfg.swiglu_limit, emulate=emu,
                      name=f"{L}.routed")
        sg = b.op("linear", bn, W(p + "ffn_gate_shexp.weight"), mode="fp8act", act_quant=emu, name=f"{L}.sh_g")
        su = b.op("linear", bn, W(p + "ffn_up_shexp.weight"), mode="fp8act", act_quant=emu, name=f"{L}.sh_u")
        sh = b.op("swiglu", sg, su, limit=cfg.swiglu_limit, name=f"{L}.sh_h")
        sh = b.op("cast", sh, dtype="bf16", name=f"{L}.sh_hb")
        ys = b.op("linear", sh, W(p + "ffn_down_shexp.weight"), mode="fp8act", act_quant=emu, name=f"{L}.shared")
        ffn = b.op("moe_sum", routed, ys, name=f"{L}.ffn_out")
        x = b.op("hc_post", ffn, x, post, comb, name="hc_out" if i == stop - 1 < cfg.n_layers - 1 else f"{L}.x")
        if i in local:  # (q): after the last local tap layer, one op records every local tap
            tapped.append(x)
            if len(tapped) == len(local):
                outputs[TAP_RING] = b.op("dspark_tap", inputs[TAP_RING], positions, *tapped, *valid,
                                         slots=tuple(local[l] for l in sorted(local)), window=cfg.window,
                                         name="taps")
    meta = {"config": cfg.name, "config_hash": cfg.hash(), "width": width, "max_ctx": max_ctx, "passes": []}
    if lanes is not None:
        meta["lanes"] = list(lanes)
    if prefill:
        meta["prefill"] = True
        if all_logits:
            meta["all_logits"] = True
    if (start, stop) != (0, cfg.n_layers):
        meta["layers"] = [start, stop]
    if local:
        meta["taps"] = list(taps)
    if stop < cfg.n_layers:  # a shard before the last: its output is the HC state
        outputs["hc_out"] = x
        return Graph(inputs, b.ops, outputs, meta)
    if record_hc:  # 7.5's X_main: the last layer's streams, the head's input
        meta["record_hc"] = True
        outputs[FINAL_HC_RING] = b.op("record_hc", inputs[FINAL_HC_RING], positions, x, *valid,
                                      rows=cfg.window + MAX_WIDTH, name="final_hc")
    # ---- head (spec 5.4)
    b.layer = -1
    if prefill and not all_logits:
        x = b.op("take_row", x, valid[0], name="head.last")
    m = b.op("hc_mix", x, W("output_hc_fn.weight"), eps=eps, name="head.mix")
    pre = b.op("hc_head_gate", m, W("output_hc_scale.weight"), W("output_hc_base.weight"), eps=cfg.hc_eps, name="head.pre")
    y = b.op("hc_premix", x, pre, name="head.y")
    y = b.op("rms_norm", y, W("output_norm.weight"), eps=eps, name="head.normed")
    outputs["logits"] = b.op("linear", y, W("output.weight"), mode="f32", name="logits")
    return Graph(inputs, b.ops, outputs, meta)
