"""The PyTorch reference of DeepSeek-V4-Flash's MTP (nextn) block as a drafter (docs/model.md 7.5).

The math (llama.cpp's ``graph_mtp``, DeepSeek-V3's MTP: the embedding of token t+1 with the main model's final
hidden state of t). A row at position ``t`` has two inputs: the token ``x_t`` at ``t`` and an HC state ``h`` [hc, D]
(the target's final HC state ``X_main(t - 1)`` before its ``hc_head``, spec 5.4.1's input; zeros for ``t = 0``, as
llama.cpp starts a sequence):

1. ``e = RMSNorm(embed[x_t]; enorm)``, ``g_c = RMSNorm(h_c; hnorm)`` per stream c (bf16, P1);
2. ``X_c = Linear_fp8(eh_proj)[D x 2D] . [e ; g_c]`` (bf16 [hc, D]): the official ``e_proj(e) + h_proj(g_c)`` as
   the single projection of the concatenation that the converter's ``eh_proj = cat(e_proj, h_proj)`` stores (one
   fp32 accumulation, one bf16 rounding; DeepSeek-V3's ``M_k [.;.]``);
3. one standard block (spec 5.2(a)-(p): HC pre, attn_norm, attention, HC post, HC pre, ffn_norm, MoE with scored
   routing, HC post; layer id ``n_layers``, compress ratio 0, RoPE theta 10000 without YaRN) whose attention sees the
   block's own KV rows of positions ``t - window + 1 .. t`` (a window ring like a target SWA layer's);
4. the output HC state ``H_t`` [hc, D], then ``hc_head`` with the file's ``output_hc_*`` (5.4.1), RMSNorm with
   ``nextn.shared_head_norm``, the target's head (fp32) -> the logits of the token at ``t + 1``.

The block's KV row of position ``t`` depends on ``(x_t, h)`` only (it is computed before the attention), so committing
positions needs no attention and no MoE: :meth:`MTPModel.commit` writes the KV rows of positions whose token and
``X_main(t - 1)`` are final (only the newest ``window`` are computed; older ones would be overwritten).
:meth:`MTPModel.chain` runs the full block from the newest committed position ``t``: row 0 is that position's row
(its KV row already in the ring), rows ``t + j`` (j = 1 .. k-1) are speculative, each pairing the token drafted by
row j - 1 with row j - 1's output state ``H_{t + j - 1}`` (llama.cpp's draft loop); their KV rows stay in a side buffer
dropped when the chain ends, so the ring only ever holds rows of committed positions.
"""

from __future__ import annotations

from typing import Callable

import torch

from ds4c.drafters.mtp_file import EH_PROJ, EMBED_TOKENS, ENORM, HEAD_NORM, HNORM, SHARED_HEAD, MTPSource, block_config
from ds4c.errors import StepError
from ds4c.reference import Reference, ReferenceWeights
from ds4c.reference import blocks as B
from ds4c.reference import primitives as P
from ds4c.reference.weights import LayerWeights

F32 = torch.float32


class _BlockTensors:
    """What :meth:`ReferenceWeights.load` reads for a one-layer model of the MTP block: ``blk.0.*`` is the source's
    ``blk.<block>.*``; ``token_embd`` / ``output`` the block's ``nextn.embed_tokens`` / ``nextn.shared_head_head``
    when present, else the target's; ``output_norm`` is ``nextn.shared_head_norm``; ``output_hc_*`` the source
    file's (module docstring of :mod:`ds4c.drafters.mtp_file`)."""

    def __init__(self, src: MTPSource, target: ReferenceWeights):
        self.config = block_config(src.file.config).replace(quant_emulation=target.config.quant_emulation)
        self._src = src
        self._shared = {}
        if not src.has(EMBED_TOKENS):
            self._shared["token_embd.weight"] = target.embed
        if not src.has(SHARED_HEAD):
            self._shared["output.weight"] = target.head

    def _name(self, name: str) -> str:
        if name.startswith("blk.0."):
            return self._src.name(name[len("blk.0."):])
        return {"token_embd.weight": self._src.name(EMBED_TOKENS), "output.weight": self._src.name(SHARED_HEAD),
                "output_norm.weight": self._src.name(HEAD_NORM)}.get(name, name)

    def tensor(self, name: str, dtype: torch.dtype = F32, device: torch.device | str | None = None) -> torch.Tensor:
        t = self._shared[name].to(dtype) if name in self._shared else self._src.file.tensor(self._name(name), dtype)
        return t if device is None else t.to(device)

    def expert(self, name: str, e: int, dtype: torch.dtype = F32, device: torch.device | str | None = None
               ) -> torch.Tensor:
        return self._src.file.expert(self._name(name), e, dtype, device=device)


class _Block(Reference):
    """The MTP block as a one-layer reference (ratio 0): its sequence state's ring is the MTP window ring. Its
    attention reads positions ``< side_p0`` from the ring and positions ``side_p0 ..`` from ``side`` (the speculative
    rows' KV) followed by the step's own rows; it writes nothing (the caller commits). ``last_kv`` holds the KV
    rows of the last step."""

    def __init__(self, weights: ReferenceWeights):
        super().__init__(weights, max_ctx=weights.config.window)
        self.side_p0 = 0
        self.side: torch.Tensor | None = None
        self.last_kv: torch.Tensor | None = None

    def kv_rows(self, lw: LayerWeights, a: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """5.2(d): the KV rows (act dtype [n, head_dim]) of the normed attention inputs ``a`` at positions ``pos``."""
        cfg = self.cfg
        kv = P.rms_norm(P.linear_q(a, lw.wkv, cfg.quant_emulation), lw.kv_norm, cfg.norm_eps)
        return B.kv_fake_quant(P.apply_rope(kv, pos, self._freqs[False]), cfg.nope_dim, cfg.quant_emulation)

    def _attention(self, i: int, lw: LayerWeights, a: torch.Tensor, pos: torch.Tensor, p0: int) -> torch.Tensor:
        cfg = self.cfg
        emu = cfg.quant_emulation
        freqs = self._freqs[False]  # ratio 0: theta 10000, no YaRN (spec P6)
        q = a.shape[0]
        qr = P.rms_norm(P.linear_q(a, lw.wq_a, emu), lw.q_norm, cfg.norm_eps)  # 5.2(c)
        qh = P.linear_q(qr, lw.wq_b, emu).view(q, cfg.n_heads, cfg.head_dim)
        qh = P.apply_rope(P.head_rms(qh, cfg.norm_eps), pos, freqs)
        kv = self.kv_rows(lw, a, pos)  # 5.2(d)
        self.last_kv = kv
        new = kv if self.side is None else torch.cat((self.side, kv))  # positions side_p0 ..
        ring = self.state.layer(0).ring
        outs = [B.attention_row(qh[r], ring, new, p0 + r, self.side_p0, cfg.window, None, None, lw.sink,
                                cfg.head_dim ** -0.5) for r in range(q)]  # (e), (i): window list, no compressed rows
        o = P.apply_rope(torch.stack(outs), pos, freqs, inverse=True)  # (j)
        og = o.view(q, cfg.o_groups, cfg.heads_per_group * cfg.head_dim)  # (k)
        woa = lw.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)
        z = torch.stack([P.linear_bf16(og[:, g], woa[g]) for g in range(cfg.o_groups)], dim=1)
        return P.linear_q(z.reshape(q, -1), lw.wo_b, emu)


class MTPModel:
    """The MTP block of spec 7.5 for one sequence, on the target's device, dataflow and quantization emulation.

    Args:
        src: the opened block (:func:`ds4c.drafters.mtp_file.open_mtp` / :func:`~ds4c.drafters.mtp_file.mtp_of_target`).
        target: the whole target's weights (their embedding and head are the block's unless the block has its own).
        cache_experts: routed experts kept dequantized (default as :meth:`ReferenceWeights.load`).

    Raises:
        StepError: ``target`` holds a layer range only. ModelFileError: the block does not fit the target's config.

    Attributes: ``cfg`` (the block's one-layer config), ``window``, ``ring_pos`` (positions ``0 .. ring_pos - 1``
    are committed: the ring holds the KV rows of the newest ``window`` of them), ``rows_written`` (KV rows committed
    since :meth:`reset`).
    """

    def __init__(self, src: MTPSource, target: ReferenceWeights, cache_experts: int | None = None):
        if not target.is_whole:
            raise StepError(f"the MTP drafter needs the whole target's weights (its embedding and head), found layers "
                            f"{list(target.layer_range)} of {target.config.n_layers}")
        src.check_target(target.config)
        self.src = src
        view = _BlockTensors(src, target)
        weights = ReferenceWeights.load(view, device=target.device,  # type: ignore[arg-type]
                                        cache_experts=cache_experts, dataflow=target.dataflow)
        self.weights = weights
        """The block's :class:`ReferenceWeights` (``layers[0]`` the block; ``embed`` / ``head`` the target's unless
        the block has its own; ``hc_head`` the source file's ``output_hc_*``; ``out_norm`` ``shared_head_norm``)."""
        self._b = _Block(weights)
        self.cfg = self._b.cfg
        self.window = self.cfg.window
        dev = target.device
        t = weights.by_name
        self.eh_proj = t[EH_PROJ] = src.file.tensor(src.name(EH_PROJ), device=dev)  # fp32 [D, 2D]
        self.enorm = t[ENORM] = src.file.tensor(src.name(ENORM), device=dev)
        self.hnorm = t[HNORM] = src.file.tensor(src.name(HNORM), device=dev)
        self.ring_pos = 0
        self.rows_written = 0

    @property
    def device(self) -> torch.device:
        return self._b.device

    @property
    def ring(self) -> torch.Tensor:
        """The window ring: act dtype [window, head_dim], the KV row of committed position t at slot t mod window."""
        return self._b.state.layer(0).ring

    def reset(self) -> None:
        """A new sequence: the ring back to zero, ``ring_pos`` 0."""
        self._b.reset()
        self.ring_pos = self.rows_written = 0

    # ---------------------------------------------------------------------------------------------- pieces
    def block_input(self, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Steps 1-2 of the module docstring: int64 [n] tokens and act dtype [n, hc, D] states -> act dtype
        [n, hc, D] (the block's incoming HC state)."""
        cfg, w = self.cfg, self.weights
        n, hc, D = h.shape
        with torch.no_grad(), P.dataflow(self._b.dataflow):
            e = P.rms_norm(w.embed[tokens].to(P.act_dtype()), self.enorm, cfg.norm_eps)  # [n, D]
            g = P.rms_norm(h.to(P.act_dtype()), self.hnorm, cfg.norm_eps)  # [n, hc, D], per stream
            cat = torch.cat((e.unsqueeze(1).expand(n, hc, D), g), dim=-1)  # [e ; g_c]
            return P.linear_q(cat.reshape(n * hc, 2 * D), self.eh_proj, cfg.quant_emulation).view(n, hc, D)

    def logits(self, hs: torch.Tensor) -> torch.Tensor:
        """Step 4: act dtype [n, hc, D] output states -> fp32 [n, vocab]."""
        cfg, w = self.cfg, self.weights
        with torch.no_grad(), P.dataflow(self._b.dataflow):
            y = P.hc_head(hs, *w.hc_head, cfg.hc_eps, cfg.norm_eps)
            return P.linear_f32(P.rms_norm(y, w.out_norm, cfg.norm_eps), w.head)

    def _check(self, tokens: torch.Tensor, h: torch.Tensor) -> None:
        cfg = self.cfg
        want = [tokens.shape[0], cfg.hc_mult, cfg.hidden_size]
        if tokens.dim() != 1 or list(h.shape) != want:
            raise StepError(f"MTP rows: expected tokens [n] and states {want}, found {list(tokens.shape)} and "
                            f"{list(h.shape)}")
        if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < cfg.vocab_size):
            raise StepError(f"MTP rows: token ids must be in 0..{cfg.vocab_size - 1}, found {tokens.tolist()}")

    # ---------------------------------------------------------------------------------------------- commit
    def commit(self, start: int, tokens: torch.Tensor, h: torch.Tensor) -> int:
        """Write the ring rows of the committed positions ``start .. start + n - 1``: row i pairs ``tokens[i]`` (at
        ``start + i``) with ``h[i]`` (the target's final HC state of ``start + i - 1``; zeros for position 0). Only
        the newest ``window`` rows are computed. Returns the rows computed.

        ``start`` is ``ring_pos``, or later when at least ``window`` rows are committed: the skipped positions'
        rows would be overwritten by this call (the caller need not have their inputs).

        Args: ``tokens`` int64 [n]; ``h`` act dtype [n, hc, D] (on the model's device).
        Raises:
            StepError: a position committed twice or skipped while still inside the window, wrong shapes or ids.
        """
        n = tokens.shape[0] if tokens.dim() == 1 else -1
        if not (start == self.ring_pos or (start > self.ring_pos and n >= self.window)):
            raise StepError(f"MTP ring: expected the rows of positions from {self.ring_pos} on (or at least "
                            f"{self.window} rows from later on), found {n} rows from {start}")
        self._check(tokens, h)
        skip = max(0, n - self.window)
        b, lw = self._b, self.weights.layers[0]
        cfg = self.cfg
        if n > skip:
            pos = torch.arange(start + skip, start + n, dtype=torch.int64, device=self.device)
            with torch.no_grad(), P.dataflow(b.dataflow):
                x = self.block_input(tokens[skip:], h[skip:])
                y, _, _ = P.hc_pre(x, *lw.hc_attn, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)  # 5.2(a)
                kv = b.kv_rows(lw, P.rms_norm(y, lw.attn_norm, cfg.norm_eps), pos)  # (b), (d)
            ring = self.ring
            for r in range(kv.shape[0]):
                ring[(start + skip + r) % self.window] = kv[r]
        self.ring_pos = start + n
        self.rows_written += n - skip
        return n - skip

    # ---------------------------------------------------------------------------------------------- draft
    def chain(self, token: int, h: torch.Tensor, k: int, pick: Callable[[torch.Tensor], int]
              ) -> tuple[list[int], torch.Tensor]:
        """Draft ``k`` tokens from the newest committed position ``p = ring_pos - 1``: row 0 is that position's row
        (``token`` at ``p`` with ``h``, act dtype [hc, D], the target's final HC state of ``p - 1``: the inputs
        :meth:`commit` was given for it); row j > 0 (at ``p + j``) pairs the token drafted from row j - 1 with row
        j - 1's output state. Every row attends the committed ring rows of its window and the chain's rows 1 .. j.
        Writes nothing to the state: rows 1 .. k-1 are speculative (their KV stay in a side buffer).

        Args:
            pick: fp32 logits [vocab] (one row) -> the drafted id (argmax or a sample).
        Returns:
            ``(drafts, logits)``: k ids and fp32 [k, vocab].
        Raises:
            StepError: nothing committed yet, ``k`` < 1, wrong shapes or ids.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise StepError(f"MTP chain: expected k >= 1 drafts, found {k!r}")
        if self.ring_pos < 1:
            raise StepError("MTP chain: no committed position to draft from (commit the context first)")
        b, lw = self._b, self.weights.layers[0]
        p = self.ring_pos - 1
        tok = torch.tensor([int(token)], dtype=torch.int64, device=self.device)
        self._check(tok, h.unsqueeze(0))
        drafts, rows = [], []
        b.side_p0, b.side = p + 1, None  # row 0 reads its own (committed) row from the ring
        try:
            with torch.no_grad(), P.dataflow(b.dataflow):
                x = self.block_input(tok, h.unsqueeze(0))
                for j in range(k):
                    pos = torch.tensor([p + j], dtype=torch.int64, device=self.device)
                    hs = b._layer(0, lw, x, tok, pos, p + j)  # the block (5.2(a)-(p)); scored routing ignores tok
                    if j:
                        b.side = b.last_kv if b.side is None else torch.cat((b.side, b.last_kv))
                    lg = self.logits(hs)[0]
                    rows.append(lg)
                    drafts.append(int(pick(lg)))
                    if j + 1 < k:
                        tok = torch.tensor([drafts[-1]], dtype=torch.int64, device=self.device)
                        x = self.block_input(tok, hs)
        finally:
            b.side, b.last_kv = None, None
        return drafts, torch.stack(rows)
