"""A batch step on the reference over the paged state pool (:class:`PagedLanes`; issue 30, docs/batching.md).

Every step is one :meth:`~ds4c.reference.Reference.step_lanes` call. Its policy (stated, and what the tests check):
every decoding sequence gets one row; the rest of the row budget (``max_rows``) goes to the prompts being prefilled,
in arrival order, each chunk cut at the next page boundary (so the prefix cache can record every full page). Decode
never waits for a prefill; a prefill always gets at least one row (``max_lanes <= max_rows``), so no prompt starves.

Admission reserves every page a request can use (``prompt + max_new_tokens`` positions, less a reused prefix): a
sequence never runs out of pages mid-run, so the pool running short is a wait in the queue, never a failure or a
neighbour's corrupted state. Cached prefixes nobody runs are evicted (least recently used first) to make room.
A prompt that begins with full pages the cache holds starts at the end of the longest such prefix: its pages
shared, the window ring and compressor state loaded from the boundary state kept there.

Speculative rows: a decoding request with a drafter (``BatchEngine.submit(draft=...)``) runs its last token and
``k`` drafts as one lane (``k`` from its fixed-width policy, as alone: at most ``spec_width - 1`` and what it still
needs); the drafts are accepted on its own logits rows by the one-sequence loop's rules (greedy, or the
rejection rule with the request's generator) and the lane's state rolled back to the kept rows, so its tokens equal
the same request run alone with the same drafter. Decode rows (speculative ones included) always run; the prompts
get what is left of ``max_rows``, at least one row.

A drafter that reads the target's final HC state (the MTP block, spec 7.5's ``X_main``) or its DSpark taps (spec
5.2(q)) is prepared on the request's own :class:`SequenceTarget`: its sequence records every row's final HC state in
a ring of its own (``SequenceState.final_hc_rows``) and its tap rows (``SequenceState.tap_rows``), both written by
``step_lanes``, so the drafter sees what it sees alone. Such a request starts from no cached prefix (the cache keeps
neither).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ds4c.batch_lane import LaneOut, nonfinite
from ds4c.config import MAX_WIDTH
from ds4c.engine_protocol import ReportsConfidence, drafter_needs
from ds4c.errors import StepError
from ds4c.sampling import accept, accept_greedy
from ds4c.speculative import call_propose
from ds4c.pages import check_page_tokens, default_page_tokens, lane_state_bytes, page_bytes
from ds4c.reference import primitives as P
from ds4c.reference.model import Reference, check_tap_layers, final_hc_rows_of, tap_rows_of
from ds4c.reference.paged import StatePool


class SequenceTarget:
    """One batch sequence as the target a drafter reads (``FinalHCReader`` and ``TapsOnRequest``, engine_protocol):
    the reference's weights and config, the sequence's position, its own final HC ring and DSpark tap rows (module
    docstring)."""

    records_final_hc = True
    records_taps = True

    def __init__(self, ref: Reference, seq: Any):
        self.ref, self.seq = ref, seq
        self.cfg, self.w = ref.cfg, ref.w

    @property
    def pos(self) -> int:
        return self.seq.pos

    @property
    def final_hc_rows(self) -> torch.Tensor | None:
        return self.seq.final_hc_rows

    def record_final_hc(self, on: bool = True) -> None:
        """Record the sequence's final HC states from now on (``on``; a ring of ``window + MAX_WIDTH`` rows) or not."""
        cfg = self.cfg
        self.seq.final_hc_rows = None if not on else torch.zeros(
            cfg.window + MAX_WIDTH, cfg.hc_mult, cfg.hidden_size, dtype=P.DATAFLOWS[self.ref.dataflow],
            device=self.ref.device)

    @property
    def taps(self) -> tuple[int, ...]:
        return self.seq.tap_layers

    def set_taps(self, layers: tuple[int, ...] | list[int]) -> None:
        """Record the DSpark taps of ``layers`` for this sequence from now on (as ``Reference.set_taps``)."""
        self.seq.tap_layers = layers = check_tap_layers(layers, 0, self.cfg.n_layers)
        self.seq.tap_rows = None if not layers else torch.zeros(
            self.seq.max_ctx, len(layers), self.cfg.hidden_size, dtype=P.DATAFLOWS[self.ref.dataflow],
            device=self.ref.device)

    def main_hidden(self, start: int, stop: int) -> torch.Tensor:
        """As ``Reference.main_hidden``, of this sequence."""
        if self.seq.tap_rows is None:
            raise StepError("main_hidden: this sequence records no taps (set_taps first)")
        return tap_rows_of(self.seq.tap_rows, self.seq.pos, start, stop)

    def final_hc(self, start: int, stop: int) -> torch.Tensor:
        """As ``Reference.final_hc``, of this sequence."""
        if self.seq.final_hc_rows is None:
            raise StepError("final_hc: this sequence records no final HC state (record_final_hc(True) first)")
        return final_hc_rows_of(self.seq.final_hc_rows, self.seq.pos, self.cfg.window, start, stop)


def _check_fits(cfg: Any, pages: int, page_tokens: int, lanes: int, device: torch.device) -> None:
    """StepError (one line) when the pool and the lanes' own state would not fit in the device's memory (the host's
    RAM for the CPU, the free memory of a CUDA device), before anything is allocated."""
    need = pages * page_bytes(cfg, page_tokens) + lanes * lane_state_bytes(cfg)
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
    if need > have:
        raise StepError(f"the page pool ({pages} pages of {page_tokens} tokens) and {lanes} lanes need "
                        f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of {device}: fewer lanes, a "
                        f"smaller max_ctx or pages=")


class PagedLanes:
    """Batch steps on the reference (module docstring).

    Args:
        ref: the whole model's reference (its own one-sequence state is not touched).
        max_ctx: positions a request may hold.
        config: a :class:`~ds4c.batching.BatchConfig`.
    """

    name = "reference"
    speculates = True
    records_final_hc = True  # a request's drafter may read its sequence's final HC state and taps (SequenceTarget)
    records_taps = True

    def __init__(self, ref: Reference, max_ctx: int, config: Any):
        if not isinstance(ref, Reference) or not ref.is_whole:
            raise StepError("continuous batching runs on the whole model's reference engine or on the compiled "
                            "step (not a layer split)")
        cfg = ref.cfg
        self.ref, self.cfg, self.config = ref, cfg, config
        page_tokens = default_page_tokens(cfg) if config.page_tokens is None else \
            check_page_tokens(cfg, config.page_tokens)
        per_seq = -(-max_ctx // page_tokens)
        pages = config.pages if config.pages is not None else config.max_lanes * per_seq
        _check_fits(cfg, pages, page_tokens, config.max_lanes, ref.device)
        self.pool = StatePool(cfg, pages, page_tokens, ref.device, config.prefix_states, config.poison)

    def check_request(self, positions: int) -> None:
        """StepError when a request of ``positions`` could never be admitted (more pages than the pool's)."""
        if self.pool.pages_for(positions) > self.pool.alloc.n_pages:
            raise StepError(f"prompt + max_new_tokens ({positions} positions) need {self.pool.pages_for(positions)} "
                            f"pages; the pool has {self.pool.alloc.n_pages}")

    def admit(self, req: Any) -> bool:
        """Reserve ``req``'s pages (its prefix reused); False: not enough pages now (it waits)."""
        pool = self.pool
        n = len(req.prompt) + req.max_new_tokens
        # a drafter reading the final HC state or taps needs the rows of the whole prompt: no cached prefix for it
        needs = drafter_needs(req.draft) if req.draft is not None else None
        recorded = needs is not None and (needs.final_hc or bool(needs.taps))
        reuse = pool.prefix.match(req.prompt) if pool.prefix_reuse and not recorded else []
        for node in reuse:  # held while pages are made room for: eviction must not take them
            pool.alloc.incref(node.page)
        try:
            if not pool.can_admit(pool.pages_for(n) - len(reuse)):
                return False
            req.seq = pool.new_sequence(n, reuse)
        finally:
            pool.alloc.release([node.page for node in reuse])
        pool.prefix.record_hit(len(reuse))
        req.reused = req.seq.pos
        req.fed = list(req.prompt[:req.seq.pos])
        return True

    def draft_target(self, req: Any) -> SequenceTarget:
        """The target ``req``'s drafter is prepared on: its own sequence (module docstring)."""
        return SequenceTarget(self.ref, req.seq)

    def run(self, active: list[Any]) -> list[LaneOut]:
        """One step of every admitted request, by the policy (module docstring)."""
        lanes, plan, drafted = [], [], {}
        decoding = [r for r in active if r.tokens]
        for req in decoding:
            rows = [req.tokens[-1]]
            if req.draft is not None:
                k = req.policy.choose(req.max_new_tokens - len(req.tokens) - 1)
                if k > 0:  # as speculative_tokens alone: propose, trim, verify [last] + drafts
                    drafts, q = call_propose(req.draft, req.prompt + req.tokens, k, self.cfg.vocab_size)
                    greedy_conf = req.temperature == 0 and isinstance(req.draft, ReportsConfidence)
                    k = req.policy.trim(len(drafts), req.draft.confidence if greedy_conf else None)
                    drafts, q = list(drafts[:k]), None if q is None else q[:k]
                    drafted[id(req)] = (drafts, q)
                    rows += drafts
            lanes.append((req.seq, rows, req.seq.pos))
            plan.append((req, len(rows)))
        budget = self.config.max_rows - sum(n for _, n in plan)
        prefilling = [r for r in active if not r.tokens]
        if prefilling and budget < 1:
            budget = 1  # a prompt always gets a row
        P = self.pool.page_tokens
        for req in prefilling:
            if budget <= 0:
                break
            pos = req.seq.pos
            n = min(budget, len(req.prompt) - pos, P - pos % P)
            lanes.append((req.seq, req.prompt[pos:pos + n], pos))
            plan.append((req, n))
            budget -= n
        logits = self.ref.step_lanes(lanes, check_finite=False)
        out = []
        for (req, n), lg in zip(plan, logits):
            seq = req.seq
            if id(req) in drafted:
                out.append(self._settle(req, n, lg, *drafted[id(req)]))
                continue
            prefill = not req.tokens
            req.fed += req.prompt[seq.pos - n:seq.pos] if prefill else [req.tokens[-1]]
            err = nonfinite(lg, seq.pos - n, seq.pos)
            if err is None:
                self.pool.cache_page(seq, req.fed)
            sample = not prefill or seq.pos == len(req.prompt)  # a decode row, or the prompt's last
            out.append(LaneOut(req, n, seq.pos if prefill else None, lg[-1:].float().cpu() if sample else None,
                               None, err))
        return out

    def _settle(self, req: Any, n: int, lg: torch.Tensor, drafts: list[int], q: Any) -> LaneOut:
        """A speculative lane's step: acceptance on its rows (the one-sequence loop's rules), its state rolled back
        to the kept rows, the pages cached."""
        seq = req.seq
        err = nonfinite(lg, seq.pos - n, seq.pos)
        if err is not None:
            return LaneOut(req, n, error=err)
        if req.temperature == 0:
            new = accept_greedy(lg.argmax(dim=-1).tolist(), drafts)
        else:
            new = accept(lg.float().cpu(), drafts, q, req.temperature, req.top_k, req.top_p, req._rng)
        seq.rollback(len(new))  # the step's first row and the accepted drafts
        req.policy.update(len(drafts), len(new) - 1)
        req.fed += ([req.tokens[-1]] + drafts)[:len(new)]
        self.pool.cache_page(seq, req.fed)
        return LaneOut(req, n, tokens=new)

    def free(self, req: Any, failed: bool = False) -> None:
        """``req`` has ended: its pages back to the pool (full prefix pages stay cached)."""
        if req.seq is not None:
            self.pool.free(req.seq)

    def stats(self, active: list[Any]) -> dict[str, int]:
        """Pages in use (by running sequences or the prefix cache), those the running sequences hold, pages in
        the pool, page size, cached prefix pages, prefix hits and the prompt positions they saved."""
        running_pages = {p for r in active if r.seq is not None and not r.seq.freed for p in r.seq.table}
        pool = self.pool
        return {"pages_in_use": pool.alloc.in_use, "pages_running": len(running_pages),
                "pages": pool.alloc.n_pages, "page_tokens": pool.page_tokens,
                "prefix_pages": len(pool.prefix.nodes), "prefix_hits": pool.prefix.hits,
                "prefix_hit_tokens": pool.prefix.hit_tokens}

    def clear_prefixes(self) -> None:
        """Drop the cached prefix pages no running sequence holds."""
        self.pool.prefix.clear()

    def close(self) -> None:
        """Nothing to release beyond the pool (freed with the engine)."""
