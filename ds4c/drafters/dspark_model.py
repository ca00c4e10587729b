"""The PyTorch reference of the DeepSeek-V4-Flash-0731 DSpark drafter (docs/model.md section 7).

The stages are run by the reference's own layer code: :class:`ds4c.reference.Reference`'s ``_layer`` (HC pre /
attn_norm / attention / HC post / HC pre / ffn_norm / MoE / HC post, spec 5.2) and ``_moe`` (scored routing with
the selection bias, routed experts in ascending id, shared expert), with the weights loaded by
:meth:`ds4c.reference.ReferenceWeights.load` from the drafter file (the target's embedding and head in place of
``token_embd`` / ``output``). Only the attention differs: DSpark's block attention (7.2), whose query / KV / output
pieces are the reference primitives of 5.2(c), (d), (i)-(k).

Per stage ``s`` a ring of ``window`` rows (128 official, the target's window) holds at slot ``t mod window`` the row
``mk_s(t) = P3(RoPE_t(RMSNorm(wkv_s . main_x(t); kv_norm_s)))`` of every committed target position ``t``, with
``main_x(t) = RMSNorm(main_proj . main_hidden(t); main_norm)`` (7.1, 7.2.1; written for the prompt at prefill,
7.4, and for each accepted position afterwards). A draft is one block of ``B = block_size`` rows ``[t0, noise x
(B-1)]`` at positions ``p+1 .. p+B`` (``p`` the newest committed position, ``t0`` the target's token at ``p+1``): every
row attends the committed ring rows (slot order) and all ``B`` block rows, non-causally (7.2.3); then the HC head,
the norm, the target's head (7.3.1-2), the sequential Markov correction and the confidence logits (7.3.3-4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4c.drafters.dspark_file import CONF_BIAS, CONF_PROJ, FC, MAIN_NORM, MARKOV_W1, MARKOV_W2, DSparkFile
from ds4c.errors import StepError
from ds4c.reference import Reference, ReferenceWeights
from ds4c.reference import blocks as B
from ds4c.reference import primitives as P
from ds4c.reference.weights import LayerWeights
from ds4c.sampling import filter_logits

F32, BF16 = torch.float32, torch.bfloat16


class _StageTensors:
    """What :meth:`ReferenceWeights.load` reads, for the stages: the drafter file's tensors, and the target's
    embedding and head under ``token_embd`` / ``output`` (the drafter file has neither: 7, "reuse the main
    model's embed and head")."""

    def __init__(self, dfile: DSparkFile, target: ReferenceWeights):
        self.config = dfile.config.replace(quant_emulation=target.config.quant_emulation)
        self._f, self._shared = dfile, {"token_embd.weight": target.embed, "output.weight": target.head}

    def tensor(self, name: str, dtype: torch.dtype = F32, device: torch.device | str | None = None) -> torch.Tensor:
        if name in self._shared:
            t = self._shared[name]
            return t if device is None else t.to(device)
        return self._f.tensor(name, dtype, device=device)  # a synthetic source makes it on ``device``

    def expert(self, name: str, e: int, dtype: torch.dtype = F32, device: torch.device | str | None = None) -> torch.Tensor:
        return self._f.expert(name, e, dtype, device=device)


class _Stages(Reference):
    """The stages as a reference of ``n_stages`` ratio-0 layers whose attention is DSpark's block attention. The
    sequence state's layer rings are the DSpark rings; nothing else of the state is used."""

    def __init__(self, weights: ReferenceWeights):
        super().__init__(weights, max_ctx=weights.config.window)
        self.causal = False
        self.n_ring = 0

    def _attention(self, i: int, lw: LayerWeights, a: torch.Tensor, pos: torch.Tensor, p0: int) -> torch.Tensor:
        """7.2 steps 2-4 for the block's rows (``a`` bf16 [B, D] at positions ``pos`` = p0 .. p0+B-1)."""
        cfg = self.cfg
        emu = cfg.quant_emulation
        freqs = self._freqs[cfg.uses_yarn(i)]  # ratio 0: theta 10000, no YaRN
        rows = a.shape[0]
        qr = P.rms_norm(P.linear_q(a, lw.wq_a, emu), lw.q_norm, cfg.norm_eps)  # 5.2(c)
        qh = P.linear_q(qr, lw.wq_b, emu).view(rows, cfg.n_heads, cfg.head_dim)
        qh = P.apply_rope(P.head_rms(qh, cfg.norm_eps), pos, freqs)
        bk = P.rms_norm(P.linear_q(a, lw.wkv, emu), lw.kv_norm, cfg.norm_eps)  # block KV as 5.2(d)
        bk = B.kv_fake_quant(P.apply_rope(bk, pos, freqs), cfg.nope_dim, emu)
        ring = self.state.layer(i).ring
        kv = torch.cat((ring[:self.n_ring], bk))  # list [0 .. n_ring-1] || the B block rows
        outs = []
        for r in range(rows):
            ok = torch.ones(kv.shape[0], dtype=torch.bool, device=kv.device)
            if self.causal:  # not DSpark: for tests and ablations only
                ok[self.n_ring + r + 1:] = False
            outs.append(P.sparse_attention(qh[r], kv, ok, lw.sink, cfg.head_dim ** -0.5))  # P9
        o = P.apply_rope(torch.stack(outs), pos, freqs, inverse=True)  # 5.2(j)
        og = o.view(rows, cfg.o_groups, cfg.heads_per_group * cfg.head_dim)  # 5.2(k)
        woa = lw.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)
        z = torch.stack([P.linear_bf16(og[:, g], woa[g]) for g in range(cfg.o_groups)], dim=1)
        return P.linear_q(z.reshape(rows, -1), lw.wo_b, emu)


@dataclass
class Draft:
    """One DSpark proposal (7.3): ``tokens`` ``out_1 .. out_B`` (ints); ``logits`` fp32 [B, V] the Markov-corrected
    logits of each depth; ``q`` fp32 [B, V] (CPU) the distributions the tokens were sampled from (None: greedy, each
    token the argmax); ``confidence`` fp32 [B] the raw confidence logits (None without ``conf_proj``)."""

    tokens: list[int]
    logits: torch.Tensor
    q: torch.Tensor | None
    confidence: torch.Tensor | None


class DSparkModel:
    """The DSpark drafter of spec section 7 for one sequence, on the reference's arithmetic and device.

    Args:
        dfile: the opened drafter file (:func:`ds4c.drafters.dspark_sources.open_dspark`; or the synthetic source
            :class:`~ds4c.drafters.dspark_source.SyntheticDSpark`, whose tensors are made on the target's device).
        target: the target's weights (the whole model: its embedding and head are the drafter's); the drafter runs
            on their device, dataflow and quantization emulation.
        cache_experts: routed experts kept dequantized (default as :meth:`ReferenceWeights.load`).

    Raises:
        ModelFileError: the drafter does not fit the target (:meth:`DSparkFile.check_target`).
        StepError: ``target`` holds a layer range only.

    Attributes: ``cfg`` (the stages' config), ``block_size``, ``taps``, ``noise_id``, ``window``, ``ring_pos`` (the
    positions ``0 .. ring_pos-1`` are in the rings).
    """

    def __init__(self, dfile: DSparkFile, target: ReferenceWeights, cache_experts: int | None = None):
        if not target.is_whole:
            raise StepError(f"the DSpark drafter needs the whole target's weights (its embedding and head), found "
                            f"layers {list(target.layer_range)} of {target.config.n_layers}")
        dfile.check_target(target.config)
        self.file = dfile
        view = _StageTensors(dfile, target)
        weights = ReferenceWeights.load(view, device=target.device,  # type: ignore[arg-type]
                                        cache_experts=cache_experts, dataflow=target.dataflow)
        self._stages = _Stages(weights)
        self.weights = weights
        """The stages' :class:`ReferenceWeights` (``layers[s]`` = stage ``s``; ``embed`` / ``head`` the target's)."""
        self.cfg = self._stages.cfg
        self.block_size, self.taps, self.noise_id = dfile.block_size, dfile.taps, dfile.noise_id
        self.window = self.cfg.window
        t = weights.by_name
        dev = target.device
        self.main_proj = t[FC] = dfile.tensor(FC, device=dev)
        self.main_norm = t[MAIN_NORM] = dfile.tensor(MAIN_NORM, device=dev)
        self.markov_w1 = dfile.tensor(MARKOV_W1, device=dev)  # fp32 of bf16 values [V, r]
        self.markov_w2 = dfile.tensor(MARKOV_W2, device=dev)
        self.conf_proj = dfile.tensor(CONF_PROJ, device=dev) if dfile.has_confidence else None  # [1, D + r]
        self.conf_bias = dfile.tensor(CONF_BIAS, device=dev) if dfile.has_conf_bias else None
        t[MARKOV_W1], t[MARKOV_W2] = self.markov_w1, self.markov_w2  # the IR's params (ds4c.ir.dspark)
        if self.conf_proj is not None:
            t[CONF_PROJ] = self.conf_proj
        if self.conf_bias is not None:
            t[CONF_BIAS] = self.conf_bias
        self.ring_pos = 0
        self.rows_written = 0
        """Ring rows computed since :meth:`reset` (per stage)."""

    @property
    def device(self) -> torch.device:
        return self._stages.device

    def reset(self) -> None:
        """A new sequence: the rings back to zero, ``ring_pos`` 0."""
        self._stages.reset()
        self.ring_pos = self.rows_written = 0

    def ring(self, stage: int) -> torch.Tensor:
        """Stage ``stage``'s ring, act dtype [window, head_dim] (row of position t at slot t mod window; a view)."""
        return self._stages.state.layer(stage).ring

    # ------------------------------------------------------------------------------------------ rings
    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """7.1: ``RMSNorm(main_proj . main_hidden; main_norm)``: act dtype [n, len(taps) * D] -> act dtype [n, D]."""
        cfg = self.cfg
        with torch.no_grad(), P.dataflow(self._stages.dataflow):
            return P.rms_norm(P.linear_q(main_hidden, self.main_proj, cfg.quant_emulation), self.main_norm,
                              cfg.norm_eps)

    def extend(self, start: int, main_hidden: torch.Tensor) -> int:
        """Write the ring rows of the committed positions ``start .. start + n - 1`` (7.2.1; the prompt at prefill,
        7.4) from their ``main_hidden`` (act dtype [n, len(taps) * D], spec 5.2(q)); only the last ``window`` are
        computed, the earlier ones would be overwritten in the same call. Returns the rows computed per stage.

        Raises:
            StepError: ``start`` is not ``ring_pos`` (a position skipped or written twice), a wrong shape.
        """
        n = main_hidden.shape[0]
        want = len(self.taps) * self.cfg.hidden_size
        if start != self.ring_pos:
            raise StepError(f"DSpark ring: expected the rows of positions from {self.ring_pos} on, found {start}")
        if main_hidden.dim() != 2 or main_hidden.shape[1] != want:
            raise StepError(f"DSpark ring: expected main_hidden [n, {want}], found {list(main_hidden.shape)}")
        skip = max(0, n - self.window)
        if n > skip:
            self._write(start + skip, main_hidden[skip:])
        self.ring_pos = start + n
        self.rows_written += n - skip
        return n - skip

    def _write(self, start: int, main_hidden: torch.Tensor) -> None:
        st, cfg = self._stages, self.cfg
        emu = cfg.quant_emulation
        mx = self.main_x(main_hidden)  # computed once, shared by the stages
        pos = torch.arange(start, start + mx.shape[0], dtype=torch.int64, device=self.device)
        with torch.no_grad(), P.dataflow(st.dataflow):
            for s, lw in enumerate(st.w.layers):
                freqs = st._freqs[cfg.uses_yarn(s)]
                mk = P.rms_norm(P.linear_q(mx, lw.wkv, emu), lw.kv_norm, cfg.norm_eps)
                mk = B.kv_fake_quant(P.apply_rope(mk, pos, freqs), cfg.nope_dim, emu)
                ring = self.ring(s)
                for r in range(mk.shape[0]):
                    ring[(start + r) % self.window] = mk[r]

    # ------------------------------------------------------------------------------------------ draft
    def block(self, t0: int, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """7.2-7.3.2: the block ``[t0, noise x (B-1)]`` at positions ``p+1 .. p+B`` (``p = ring_pos - 1``) through the
        stages, every row attending the ``min(window, p+1)`` committed ring rows and the block rows.

        Args:
            t0: the anchor token (the target's token at ``p + 1``).
            causal: block row ``i`` attends block rows ``0..i`` only (not DSpark; for tests and ablations).
        Returns:
            ``(base, hx)``: fp32 [B, V] the head's logits of every row, and ``hx`` act dtype [B, D] the pre-norm HC-head
            output (the confidence head's input).
        Raises:
            StepError: ``t0`` outside the vocabulary.
        """
        st, cfg = self._stages, self.cfg
        if isinstance(t0, bool) or not 0 <= int(t0) < cfg.vocab_size:
            raise StepError(f"DSpark anchor token must be in 0..{cfg.vocab_size - 1}, found {t0!r}")
        w = st.w
        p0 = self.ring_pos  # = p + 1
        tok = torch.tensor([int(t0)] + [self.noise_id] * (self.block_size - 1), dtype=torch.int64, device=self.device)
        pos = torch.arange(p0, p0 + self.block_size, dtype=torch.int64, device=self.device)
        st.causal, st.n_ring = causal, min(self.window, p0)
        with torch.no_grad(), P.dataflow(st.dataflow):
            x = w.embed[tok].to(P.act_dtype()).unsqueeze(1).expand(-1, cfg.hc_mult, cfg.hidden_size).contiguous()
            for i, lw in enumerate(w.layers):
                x = st._layer(i, lw, x, tok, pos, p0)
            hx = P.hc_head(x, *w.hc_head, cfg.hc_eps, cfg.norm_eps)  # 7.3.1
            base = P.linear_f32(P.rms_norm(hx, w.out_norm, cfg.norm_eps), w.head)  # 7.3.2
        return base, hx

    def markov(self, base: torch.Tensor, hx: torch.Tensor, t0: int, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, generator: torch.Generator | None = None) -> Draft:
        """7.3.3-4: for ``i = 0 .. B-1``: ``emb_i = markov_w1[out_i]`` (``out_0 = t0``), ``logits_i = base_i +
        markov_w2 . emb_i`` (fp32), ``out_{i+1}`` = argmax (``temperature == 0``; ties to the lower id) or a sample of
        ``softmax(filter(logits_i) / temperature)`` (top-k / top-p as :func:`ds4c.sampling.filter_logits`, drawn with
        ``generator`` on the CPU), and ``confidence_i = conf_proj . [hx_i ; emb_i] (+ bias)`` (fp32 logits).

        Args: ``base`` fp32 [B, V] and ``hx`` [B, D] from :meth:`block`.
        """
        out, rows, qs, conf = [], [], [], []
        prev = int(t0)
        with torch.no_grad():
            for i in range(base.shape[0]):
                emb = self.markov_w1[prev]
                li = base[i] + P.linear_f32(emb, self.markov_w2)
                rows.append(li)
                if self.conf_proj is not None:
                    c = P.linear_f32(torch.cat((hx[i].to(F32), emb)), self.conf_proj)
                    conf.append(c + self.conf_bias if self.conf_bias is not None else c)
                if temperature == 0:
                    prev = int(torch.argmax(li))
                else:
                    lf = filter_logits(li.float().cpu().unsqueeze(0), temperature, top_k, top_p)
                    qi = torch.softmax(lf / temperature, dim=-1)[0]
                    prev = int(torch.multinomial(qi, 1, generator=generator))
                    qs.append(qi)
                out.append(prev)
        return Draft(out, torch.stack(rows), torch.stack(qs) if qs else None,
                     torch.cat(conf) if conf else None)

    def draft(self, t0: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
              generator: torch.Generator | None = None) -> Draft:
        """:meth:`block` then :meth:`markov`: the ``B`` draft tokens after ``t0`` (see both)."""
        base, hx = self.block(t0)
        return self.markov(base, hx, t0, temperature, top_k, top_p, generator)
