"""The PyTorch reference of one DeepSeek-V4-Flash decode step and one q-row verify step.

Written from docs/model.md sections 3-6 for readability, not speed: token-local work is batched over
the q rows (row by row inside each product, so results are batch-invariant), the window, compressors,
indexer and attention run row by row in position order so a verify step of q rows equals q sequential
decode steps bit for bit (section 6).

Window ring in verify: row i attends positions ``max(0, p_i - window + 1) .. p_i``; positions before the
step come from the ring (not yet overwritten), positions of this step from the step's own KV rows; the q
new rows are written to the ring after all rows attended (the side-buffer scheme of section 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ds4c.config import MAX_WIDTH, Ds4Config
from ds4c.errors import StepError
from ds4c.reference import blocks as B
from ds4c.reference import primitives as P
from ds4c.reference.state import CompressorState, SequenceState
from ds4c.reference.weights import Compressor, LayerWeights, ReferenceWeights

BF16, F32 = torch.bfloat16, torch.float32


@dataclass
class Lane:
    """One sequence's part of a step of several (:meth:`Reference.step_lanes`): its ``state``, the ``tokens`` of
    its rows and the position ``pos`` of the first (the state's next position)."""

    state: SequenceState
    tokens: list[int]
    pos: int



def final_hc_rows_of(rows: torch.Tensor, pos: int, window: int, start: int, stop: int) -> torch.Tensor:
    """Positions ``start .. stop - 1`` of a final HC ring (``window + MAX_WIDTH`` rows, row ``t mod`` its rows) of a
    sequence at ``pos``: a copy. StepError unless the range is inside the newest ``window`` committed positions."""
    lo = max(0, pos - window)
    if not lo <= start <= stop <= pos:
        raise StepError(f"final_hc: expected positions inside the newest committed {lo}..{pos - 1}, found "
                        f"{start}..{stop - 1}")
    idx = torch.arange(start, stop, device=rows.device) % rows.shape[0]
    return rows[idx]


def check_tap_layers(layers: Any, start: int, stop: int) -> tuple[int, ...]:
    """DSpark tap layers as a tuple of ints; StepError unless distinct layer ids in ``start .. stop - 1``."""
    layers = tuple(layers)
    if any(isinstance(l, bool) or not isinstance(l, (int, np.integer)) or not start <= l < stop for l in layers) \
            or len(set(layers)) != len(layers):
        raise StepError(f"taps: expected distinct layer ids in {start}..{stop - 1}, found {list(layers)}")
    return tuple(int(l) for l in layers)


def tap_rows_of(rows: torch.Tensor, pos: int, start: int, stop: int) -> torch.Tensor:
    """``main_hidden`` of positions ``start .. stop - 1`` from tap rows ``[max_ctx, taps, hidden]`` of a sequence at
    ``pos`` (a view). StepError unless the positions are committed."""
    if not 0 <= start <= stop <= pos:
        raise StepError(f"main_hidden: positions {start}..{stop - 1} are not all committed (the sequence is at "
                        f"position {pos})")
    return rows[start:stop].flatten(1)

class Reference:
    """Reference decode/verify for one sequence at a time.

    Usage::

        ref = Reference(ReferenceWeights.load(open_model(path)), max_ctx=4096)
        logits = ref.verify([t0, t1, t2], pos=0)   # fp32 [3, vocab]
        logits = ref.decode(t3, pos=3)             # fp32 [1, vocab]
        ref.reset()                                # next sequence

    After a verify step, :meth:`rollback` keeps any prefix of its rows; the next step commits it.

    Shard mode: with the weights of a layer range (``ReferenceWeights.load(..., layers=(start, stop))``) the
    reference holds the state of those layers only and runs them with :meth:`run` (the incoming HC state in,
    the outgoing HC state or the logits out); :meth:`verify` / :meth:`decode` need the whole model
    (:class:`~ds4c.reference.sharded.ShardedReference` runs the shards of a split).

    Args:
        weights: the loaded weights (their ``config.quant_emulation`` decides the FP8/FP4 emulation; their
            ``layer_range`` the layers this reference runs).
        max_ctx: positions the sequence state holds.
        taps: layers after which the DSpark taps are recorded (spec 5.2(q); official ``(40, 41, 42)``), see
            :meth:`set_taps`; empty: none.
        dataflow: ``"bf16"``: activations and KV rounded to bf16 between operations as the official
            checkpoint runs (the spec); ``"fp32"``: no rounding between operations, fp32 KV and the unrounded
            ``wo_a`` (weights loaded with ``dataflow="fp32"``), the arithmetic of ports that keep fp32
            activations (llama.cpp with an F32 KV cache), for token-exact comparisons with them
            (docs/interop.md). ``None``: the weights' dataflow. Not a model property; the compiled step is
            bf16 only.

    Raises:
        StepError: an unknown ``dataflow`` or one the weights were not loaded for, ``max_ctx`` outside
            1..max_position, ``taps`` as :meth:`set_taps` raises.
    """

    records_taps = True
    """:meth:`set_taps` makes its steps record the target taps a DSpark drafter reads (spec 5.2(q))."""
    records_final_hc = True
    """:meth:`record_final_hc` makes its steps record the final HC state an MTP drafter reads (spec 7.5)."""

    def __init__(self, weights: ReferenceWeights, max_ctx: int = 4096, dataflow: str | None = None,
                 taps: tuple[int, ...] = ()):
        dataflow = weights.dataflow if dataflow is None else dataflow
        if dataflow not in P.DATAFLOWS:
            raise StepError(f"dataflow must be one of {sorted(P.DATAFLOWS)}, found {dataflow!r}")
        if dataflow != weights.dataflow:
            raise StepError(f"dataflow {dataflow!r} needs weights loaded with ReferenceWeights.load(..., "
                            f"dataflow={dataflow!r}); these were loaded for {weights.dataflow!r}")
        self.dataflow = dataflow
        self.w = weights
        self.cfg: Ds4Config = weights.config
        self.device = weights.device
        self.max_ctx = max_ctx
        self.layer_range: tuple[int, int] = tuple(weights.layer_range)  # type: ignore[assignment]
        cfg = self.cfg
        self._freqs = {
            False: P.rope_freqs(cfg.rope_dim, cfg.rope_theta, False, cfg.rope_factor, cfg.original_seq_len,
                                cfg.beta_fast, cfg.beta_slow).to(self.device),
            True: P.rope_freqs(cfg.rope_dim, cfg.compress_rope_theta, True, cfg.rope_factor,
                               cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow).to(self.device),
        }
        self.state = self._new_state()
        self.set_taps(taps)
        self.final_hc_rows: torch.Tensor | None = None
        """With :meth:`record_final_hc` on: act dtype ``[window + MAX_WIDTH, hc_mult, hidden]``, the HC state
        after the last layer (before ``hc_head``) of position t at row ``t mod (window + MAX_WIDTH)``."""

    @property
    def is_whole(self) -> bool:
        """True when this reference runs every layer (not one shard of a layer split)."""
        return self.layer_range == (0, self.cfg.n_layers)

    @property
    def is_first(self) -> bool:
        """True when the layer range starts at layer 0 (the shard embeds the tokens)."""
        return self.layer_range[0] == 0

    @property
    def is_last(self) -> bool:
        """True when the layer range ends at the last layer (the shard returns logits)."""
        return self.layer_range[1] == self.cfg.n_layers

    @property
    def pos(self) -> int:
        """The sequence's next position (``state.pos``)."""
        return self.state.pos

    # ---------------------------------------------------------------------------------------------- API
    def reset(self) -> None:
        """Start a new sequence: every state buffer back to its initial value, pos = 0."""
        self.state = self._new_state()

    def _new_state(self) -> SequenceState:
        with P.dataflow(self.dataflow):
            return SequenceState.new(self.cfg, self.max_ctx, self.device, layers=self.layer_range)

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """One decode step (q = 1) for ``token`` at position ``pos``. Returns fp32 logits [1, vocab].

        Raises:
            StepError: ``pos`` is not the next position of the sequence, is past ``max_ctx``, or the token
                id is outside the vocabulary; this reference is one shard of a layer split.
        """
        return self.verify([token], pos)

    def verify(self, tokens: list[int] | torch.Tensor, pos: int) -> torch.Tensor:
        """A verify step: ``q = len(tokens)`` rows at positions ``pos .. pos+q-1`` (spec section 6).

        Returns fp32 logits [q, vocab], row i equal to what the i-th of q sequential decodes gives.

        Raises:
            StepError: q outside 1..5, ``pos`` not the sequence's next position, positions past
                ``max_ctx``, a token id outside 0..vocab-1; this reference is one shard of a layer split
                (run the shards with :class:`~ds4c.reference.sharded.ShardedReference`).
        """
        if not self.is_whole:
            a, b = self.layer_range
            raise StepError(f"verify/decode on a shard of layers [{a},{b}) of {self.cfg.n_layers}: expected the "
                            f"whole model; run a layer split with ds4c.reference.sharded.ShardedReference "
                            f"(or Reference.run per shard)")
        toks = self._check_step(tokens, pos)
        with torch.no_grad(), P.dataflow(self.dataflow):
            logits = self._step(toks, pos)
        self._check_finite(logits, pos, len(toks))
        return logits

    def step_lanes(self, lanes: list[tuple[SequenceState, list[int], int]],
                   check_finite: bool = True) -> list[torch.Tensor]:
        """One step of several sequences ("lanes", docs/batching.md): lane ``(state, tokens, pos)`` runs
        ``len(tokens)`` rows (1 for a decode, several for a verify or a prompt chunk) at positions ``pos ..`` on
        its own ``state`` (this reference's own :attr:`state` untouched). The row-wise work (projections, experts,
        HC) runs over every lane's rows; attention, compressors, indexer and state writes per lane. Each lane's
        logits and state equal a step of that lane alone bit for bit (the primitives are row-invariant).
        Returns the fp32 logits ``[len(tokens), vocab]`` of each lane, in order. After it, ``state.rollback``
        keeps a prefix of a lane's rows. ``check_finite``: raise for a lane whose logits are not finite (False: the
        caller checks each lane's, so one lane's NaN fails that lane only).

        Raises:
            StepError: no lanes, a lane with no tokens, a state of another model or layer range, the same state
                twice, a position that is not the state's next one or past its ``max_ctx``, a token id outside the
                vocabulary; taps or final HC recording on (one sequence's rings: lanes do not record them); this
                reference is a shard of a layer split.
        """
        if not self.is_whole:
            raise StepError("step_lanes needs the whole model, not a shard of a layer split")
        if self.tap_rows is not None or self.final_hc_rows is not None:
            raise StepError("step_lanes: this reference records DSpark taps or the final HC state (one sequence's "
                            "rings); lanes record neither: switch them off (set_taps(()), record_final_hc(False))")
        if not lanes:
            raise StepError("step_lanes: expected at least one lane")
        checked, seen = [], set()
        for k, lane in enumerate(lanes):
            try:
                st, tokens, pos = lane
            except (TypeError, ValueError):
                raise StepError(f"lane {k}: expected (state, tokens, pos), found {lane!r:.60}") from None
            if not isinstance(st, SequenceState) or st.config != self.cfg or st.layer_range != self.layer_range:
                raise StepError(f"lane {k}: expected a sequence state of this model ({self.cfg.name}, every layer)")
            if id(st) in seen:
                raise StepError(f"lane {k}: the same sequence state is in two lanes")
            seen.add(id(st))
            toks = self._check_tokens(tokens, pos, st, width=None)
            checked.append(Lane(st, toks, pos))
        with torch.no_grad(), P.dataflow(self.dataflow):
            logits = self._lanes_step(checked)
        out, base = [], 0
        for ln in checked:
            n = len(ln.tokens)
            if check_finite:
                self._check_finite(logits[base:base + n], ln.pos, n)
            out.append(logits[base:base + n])
            base += n
        return out

    def run(self, tokens: list[int] | torch.Tensor, pos: int, x: torch.Tensor | None = None) -> torch.Tensor:
        """This shard's part of a verify step of ``q = len(tokens)`` rows at positions ``pos .. pos+q-1``.

        Args:
            tokens: the step's token ids (every shard needs them: hash-routed layers route by token id).
            pos: the position of the first row (the shard's state must be at it).
            x: None when the layer range starts at layer 0 (the tokens are embedded); else the incoming HC
                state of the previous shard, act dtype (bf16; fp32 in the fp32 dataflow) ``[q, hc_mult,
                hidden]`` on this reference's device. Not modified.

        Returns:
            the outgoing HC state, act dtype ``[q, hc_mult, hidden]``, when the range ends before the last
            layer; else fp32 logits ``[q, vocab]`` (as :meth:`verify`). On the whole model equal to
            :meth:`verify` bit for bit.

        Raises:
            StepError: as :meth:`verify` (width, position, max_ctx, token ids); ``x`` given to the first shard
                or missing for another; ``x`` of the wrong dtype, shape or device.
        """
        toks = self._check_step(tokens, pos)
        q = len(toks)
        if self.is_first:
            if x is not None:
                raise StepError(f"run: the shard of layers [0,{self.layer_range[1]}) embeds the tokens: expected "
                                f"x=None, found a tensor of shape {list(x.shape)}")
        else:
            want_dtype = P.DATAFLOWS[self.dataflow]  # the act dtype of this dataflow
            want = [q, self.cfg.hc_mult, self.cfg.hidden_size]
            if not isinstance(x, torch.Tensor):
                raise StepError(f"run: layers [{self.layer_range[0]},{self.layer_range[1]}) need the incoming HC "
                                f"state: expected a {want_dtype} tensor {want}, found {type(x).__name__}")
            if x.dtype != want_dtype or list(x.shape) != want:
                raise StepError(f"run: incoming HC state: expected {want_dtype} {want}, found {x.dtype} "
                                f"{list(x.shape)}")
            if x.device != self.device:
                raise StepError(f"run: incoming HC state: expected a tensor on {self.device}, found {x.device}")
        with torch.no_grad(), P.dataflow(self.dataflow):
            out = self._step(toks, pos, x)
        if self.is_last:
            self._check_finite(out, pos, q)
        return out

    def set_taps(self, layers: tuple[int, ...] | list[int]) -> None:
        """Record the DSpark taps from now on (spec 5.2(q)): after each layer ``l`` of ``layers`` the bf16 mean over
        the HC streams of every step row goes to ``tap_rows[pos, j]`` (``j`` = the index of ``l`` in ``layers``),
        act dtype ``[max_ctx, len(layers), hidden]``; a row of a rolled-back position is overwritten when the
        position is computed again, so rows below ``state.pos`` are those of the committed tokens
        (:meth:`main_hidden`). An empty ``layers`` records nothing (``tap_rows`` None).

        Raises:
            StepError: a layer that is not an int of this reference's layer range, or a repeated one.
        """
        self.taps = layers = check_tap_layers(layers, *self.layer_range)
        self._tap_of = {l: j for j, l in enumerate(self.taps)}
        self.tap_rows = None if not layers else torch.zeros(
            self.max_ctx, len(layers), self.cfg.hidden_size, dtype=P.DATAFLOWS[self.dataflow], device=self.device)

    def main_hidden(self, start: int, stop: int) -> torch.Tensor:
        """``main_hidden`` of the committed positions ``start .. stop - 1`` (spec 5.2(q)): the taps concatenated in
        ``taps`` order, act dtype ``[stop - start, len(taps) * hidden]`` (a view of ``tap_rows``, not a copy).

        Raises:
            StepError: no taps are recorded, or the range is not inside ``0 .. state.pos``.
        """
        if self.tap_rows is None:
            raise StepError("main_hidden: this reference records no taps (Reference(..., taps=...) or set_taps)")
        return tap_rows_of(self.tap_rows, self.state.pos, start, stop)

    def record_final_hc(self, on: bool = True) -> None:
        """Record from now on (``on``) or not the final HC state ``X`` of every step row: the 4 streams after the
        last layer, before the HC head (spec 5.4.1's input; ``X_main`` of spec 7.5, the MTP drafter's input), act
        dtype, into a ring of ``window + MAX_WIDTH`` rows (the newest committed ``window`` positions stay readable
        after any rollback, :meth:`final_hc`). Off (the default) costs the step nothing; turning it on again
        keeps no earlier rows.

        Raises:
            StepError: this reference is a shard that does not end at the last layer.
        """
        if not on:
            self.final_hc_rows = None
            return
        if not self.is_last:
            a, b = self.layer_range
            raise StepError(f"record_final_hc: the shard of layers [{a},{b}) does not run the last layer "
                            f"({self.cfg.n_layers - 1}), whose output the final HC state is")
        self.final_hc_rows = torch.zeros(self.cfg.window + MAX_WIDTH, self.cfg.hc_mult, self.cfg.hidden_size,
                                         dtype=P.DATAFLOWS[self.dataflow], device=self.device)

    def final_hc(self, start: int, stop: int) -> torch.Tensor:
        """The final HC states of the committed positions ``start .. stop - 1`` (see :meth:`record_final_hc`): act
        dtype ``[stop - start, hc_mult, hidden]`` (a copy). Rows of rolled-back positions are overwritten when the
        position is computed again; a verify step writes at most ``MAX_WIDTH`` rows past the committed ones, so the
        ring of ``window + MAX_WIDTH`` rows always holds the newest ``window`` committed positions.

        Raises:
            StepError: recording is off, or the range is not inside the newest ``window`` committed positions
                ``max(0, pos - window) .. pos - 1``.
        """
        if self.final_hc_rows is None:
            raise StepError("final_hc: this reference records no final HC state (record_final_hc(True) first)")
        return final_hc_rows_of(self.final_hc_rows, self.state.pos, self.cfg.window, start, stop)

    def rollback(self, accepted: int) -> None:
        """Keep the first ``accepted`` rows of the last verify step; undo the state writes of the rest."""
        self.state.rollback(accepted)

    def snapshot(self) -> SequenceState:
        """A full copy of the sequence state."""
        return self.state.snapshot()

    def restore(self, snap: SequenceState) -> None:
        """Restore a :meth:`snapshot`."""
        self.state.restore(snap)

    # ---------------------------------------------------------------------------------------------- checks
    def _check_step(self, tokens: list[int] | torch.Tensor, pos: int) -> list[int]:
        """The step's token ids as ints, after the width, position, max_ctx and vocabulary checks."""
        return self._check_tokens(tokens, pos, self.state, width=MAX_WIDTH)

    def _check_tokens(self, tokens: list[int] | torch.Tensor, pos: int, st: SequenceState,
                      width: int | None) -> list[int]:
        """``tokens`` as ints for a step of ``st`` at ``pos``: at most ``width`` of them (None: any number >= 1),
        ``pos`` the state's next position, inside its ``max_ctx``, ids in the vocabulary."""
        raw = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in raw):
            raise StepError(f"token ids must be integers, found {raw}")
        toks = [int(t) for t in raw]
        q = len(toks)
        if width is not None and not 1 <= q <= width:
            raise StepError(f"verify width must be in 1..{width}, found {q}")
        if q < 1:
            raise StepError("a step needs at least one token")
        if pos != st.pos:
            raise StepError(f"step at position {pos}, but the sequence's next position is {st.pos} "
                            f"(call reset() for a new sequence, or rollback() after a verify)")
        if pos + q > st.max_ctx:
            raise StepError(f"positions {pos}..{pos + q - 1} exceed max_ctx={st.max_ctx}")
        bad = [t for t in toks if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise StepError(f"token ids must be in 0..{self.cfg.vocab_size - 1}, found {bad}")
        return toks

    @staticmethod
    def _check_finite(logits: torch.Tensor, pos: int, q: int) -> None:
        if not bool(torch.isfinite(logits).all()):
            raise StepError(f"non-finite logits at positions {pos}..{pos + q - 1}: the weights or the config "
                            f"hold NaN/inf values")

    # ---------------------------------------------------------------------------------------------- step
    def _step(self, toks: list[int], p0: int, x: torch.Tensor | None = None) -> torch.Tensor:
        """The layers of ``layer_range`` for the step's rows: from the embedded tokens (``x`` None) or the
        incoming HC state ``x``; returns the outgoing HC state, or the logits when the range ends at the
        last layer."""
        return self._lanes_step([Lane(self.state, toks, p0)], x)

    def _lanes_step(self, lanes: list["Lane"], x: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`_step` of several sequences' rows at once (lane after lane): the row-wise work on all rows
        together, attention, compressors and state writes per lane on its own state. Row-invariant primitives
        make each lane's rows bit-identical to a step of that lane alone."""
        cfg, w = self.cfg, self.w
        for ln in lanes:
            ln.state.begin_step(len(ln.tokens))
        tok = torch.tensor([t for ln in lanes for t in ln.tokens], dtype=torch.int64, device=self.device)
        pos = torch.tensor([ln.pos + r for ln in lanes for r in range(len(ln.tokens))], dtype=torch.int64,
                           device=self.device)
        q = tok.shape[0]
        if x is None:
            e = w.embed[tok].to(P.act_dtype())  # 5.1: bf16 [q, D] (fp32 in the fp32 dataflow)
            x = e.unsqueeze(1).expand(q, cfg.hc_mult, cfg.hidden_size).contiguous()
        for i, lw in zip(range(*self.layer_range), w.layers):
            x = self._layer(i, lw, x, tok, pos, lanes)
            if i in self._tap_of:  # 5.2(q): the bf16 mean over the HC streams, per row (one lane: see step_lanes)
                p0 = lanes[0].pos
                self.tap_rows[p0:p0 + q, self._tap_of[i]] = x.mean(dim=-2)
            row = 0
            for ln in lanes:  # a batch's sequences that record taps (SequenceState.tap_rows)
                n = len(ln.tokens)
                if ln.state.tap_rows is not None and i in ln.state.tap_layers:
                    ln.state.tap_rows[ln.pos:ln.pos + n, ln.state.tap_layers.index(i)] = x[row:row + n].mean(dim=-2)
                row += n
        if not self.is_last:  # the boundary of a layer split: the HC state of the step's rows
            for ln in lanes:
                ln.state.pos = ln.pos + len(ln.tokens)
            return x
        if self.final_hc_rows is not None:  # spec 7.5's X_main, for an MTP drafter (one lane)
            n = self.final_hc_rows.shape[0]
            for r in range(q):
                self.final_hc_rows[(lanes[0].pos + r) % n] = x[r]
        row = 0
        for ln in lanes:  # a batch's sequences that record it (SequenceState.final_hc_rows)
            ring = ln.state.final_hc_rows
            if ring is not None:
                for r in range(len(ln.tokens)):
                    ring[(ln.pos + r) % ring.shape[0]] = x[row + r]
            row += len(ln.tokens)
        y = P.hc_head(x, *w.hc_head, cfg.hc_eps, cfg.norm_eps)  # 5.4
        y = P.rms_norm(y, w.out_norm, cfg.norm_eps)
        logits = P.linear_f32(y, w.head)
        for ln in lanes:
            ln.state.pos = ln.pos + len(ln.tokens)
        return logits

    def _layer(self, i: int, lw: LayerWeights, x: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor,
               lanes: list["Lane"]) -> torch.Tensor:
        cfg = self.cfg
        y, post, comb = P.hc_pre(x, *lw.hc_attn, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)  # (a)
        a = P.rms_norm(y, lw.attn_norm, cfg.norm_eps)  # (b)
        out = self._attention(i, lw, a, pos, lanes)  # (c)-(k)
        x = P.hc_post(out, x, post, comb)  # (l)
        y, post, comb = P.hc_pre(x, *lw.hc_ffn, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)  # (m)
        b = P.rms_norm(y, lw.ffn_norm, cfg.norm_eps)  # (n)
        return P.hc_post(self._moe(i, lw, b, tok), x, post, comb)  # (o), (p)

    # ---------------------------------------------------------------------------------------------- attention
    def _attention(self, i: int, lw: LayerWeights, a: torch.Tensor, pos: torch.Tensor,
                   lanes: list["Lane"]) -> torch.Tensor:
        cfg = self.cfg
        emu = cfg.quant_emulation
        r = cfg.ratio(i)
        freqs = self._freqs[cfg.uses_yarn(i)]
        q = a.shape[0]
        # (c) query path
        qr = P.rms_norm(P.linear_q(a, lw.wq_a, emu), lw.q_norm, cfg.norm_eps)
        qh = P.linear_q(qr, lw.wq_b, emu).view(q, cfg.n_heads, cfg.head_dim)
        qh = P.apply_rope(P.head_rms(qh, cfg.norm_eps), pos, freqs)
        # (d) window KV of the step's tokens
        kv = P.rms_norm(P.linear_q(a, lw.wkv, emu), lw.kv_norm, cfg.norm_eps)
        kv = B.kv_fake_quant(P.apply_rope(kv, pos, freqs), cfg.nope_dim, emu)
        # (f) indexer query and head weights (ratio-4 layers)
        if r == 4:
            qi = P.linear_q(qr, lw.idx_wq_b, emu).view(q, cfg.index_n_heads, cfg.index_head_dim)
            qi = P.hadamard(P.apply_rope(qi, pos, freqs))
            if emu:
                qi = P.fp4_fake_quant(qi, 32)
            scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
            hw = (P.linear_bf16(a, lw.idx_proj).to(F32) * scale).to(P.act_dtype())
        comp_in = idx_in = None
        if r:  # compressor projections of every row (5.3), fp32 from the bf16 normed input
            comp_in = (P.linear_f32(a, lw.compressor.wkv), P.linear_f32(a, lw.compressor.wgate))
            if r == 4:
                idx_in = (P.linear_f32(a, lw.idx_compressor.wkv), P.linear_f32(a, lw.idx_compressor.wgate))
        outs = []
        base = 0
        for ln in lanes:  # the sequence-dependent part, each lane on its own state
            st, p0, n = ln.state, ln.pos, len(ln.tokens)
            ls = st.layer(i)
            rows = slice(base, base + n)
            lane_kv = kv[rows]
            for row in range(n):
                p, g = p0 + row, base + row
                comp, comp_ok = None, None
                if r == 4:  # (f.4-7): indexer compressor first, so a just-finished block is visible
                    self._compress(st, lw.idx_compressor, ls.idx_state, ls.idx_keys, idx_in, row, g, p, 4,
                                   cfg.index_head_dim, freqs, indexer=True)
                    T = (p + 1) // 4
                    sel = B.indexer_select(ls.idx_keys[:T], torch.ones(T, dtype=torch.bool, device=self.device),
                                           qi[g], hw[g], cfg.index_topk)
                if r:  # (h.2) main compressor
                    self._compress(st, lw.compressor, ls.comp_state, ls.comp, comp_in, row, g, p, r, cfg.head_dim,
                                   freqs, indexer=False)
                    if r == 4:  # CSA: the selected blocks in descending score order
                        comp, comp_ok = ls.comp[sel], sel >= 0
                    else:  # (g) HCA: all completed blocks
                        comp = ls.comp[: (p + 1) // r]
                        comp_ok = torch.ones(comp.shape[0], dtype=torch.bool, device=self.device)
                outs.append(B.attention_row(qh[g], ls.ring, lane_kv, p, p0, cfg.window, comp, comp_ok, lw.sink,
                                            cfg.head_dim ** -0.5))  # (e), (i)
            for row in range(n):  # (h.1) ring writes after every row attended (side-buffer scheme)
                st.write(ls.ring, (p0 + row) % cfg.window, lane_kv[row], row)
            base += n
        o = P.apply_rope(torch.stack(outs), pos, freqs, inverse=True)  # (j)
        # (k) grouped wo_a (bf16 einsum on the dequantized weight), then wo_b
        og = o.view(q, cfg.o_groups, cfg.heads_per_group * cfg.head_dim)
        woa = lw.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)
        z = torch.stack([P.linear_bf16(og[:, g], woa[g]) for g in range(cfg.o_groups)], dim=1)
        return P.linear_q(z.reshape(q, -1), lw.wo_b, emu)

    def _compress(self, st: SequenceState, cw: Compressor, cs: CompressorState, rows: torch.Tensor,
                  proj: tuple[torch.Tensor, torch.Tensor], row: int, g: int, p: int, r: int, d: int,
                  freqs: torch.Tensor, indexer: bool) -> None:
        """Compressor update for one token (spec 5.3) of sequence ``st`` (its step row ``row``, row ``g`` of the
        projections); on a flush the finished row j = p // r is written to ``rows``. Every write is journaled
        under verify row ``row``."""
        cfg = self.cfg

        def write(buf: torch.Tensor, index, value: torch.Tensor) -> None:
            st.write(buf, index, value, row)

        cvec = B.compress_token(cs.kv, cs.score, proj[0][g], proj[1][g] + cw.ape[p % r], p, r, d, write)
        if cvec is not None:
            write(rows, p // r, B.finish_compressed_row(cvec, cw.norm, p, r, freqs, cfg.norm_eps, indexer,
                                                         cfg.quant_emulation, cfg.nope_dim))

    # ---------------------------------------------------------------------------------------------- MoE
    def _moe(self, i: int, lw: LayerWeights, b: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """(o) Router (hash or scored), routed experts in ascending id, then the shared expert; fp32 sum."""
        cfg = self.cfg
        emu = cfg.quant_emulation
        s = P.sqrtsoftplus(P.linear_f32(b, lw.gate))  # [q, E]
        ids, wts = B.route(s, lw.gate_bias, None if lw.tid2eid is None else lw.tid2eid[tok],
                           cfg.n_active_experts, cfg.route_scale)
        outs = []
        for row in range(b.shape[0]):
            x = b[row:row + 1]
            acc = B.routed_sum(x, ids[row], wts[row], lambda e: self.w.experts.get(i, e), cfg.swiglu_limit, emu)
            acc += B.expert_ffn(x, lw.sh_w1, lw.sh_w3, lw.sh_w2, None, cfg.swiglu_limit, emu).to(F32)
            outs.append(acc.to(P.act_dtype()))
        return torch.cat(outs)
