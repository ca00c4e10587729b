"""A batch step on the compiled step (:class:`SlotLanes`; issue 30, docs/batching.md): decode lanes over sequence
slots (:class:`~ds4c.runtime.step.lanes.LanesStep`), prompts prefilled on the one-sequence step.

* **Slots.** A running sequence holds a slot: its whole state at the step's capacity on the device. The lanes graph
  binds lane j to slot j, so the decoding sequences occupy slots ``0 .. n-1``; one that ends gives its slot to the
  last (a device copy of its state), the step it ends.
* **Policy** (stated, and what the tests check): a step is one decode row of every sequence in a slot (one lanes
  graph, weights read once for all of them), then one *piece* of the prompt being prefilled, on the one-sequence
  step's chunk graphs (or its verify steps): the chunk the one-sequence prefill policy
  (:func:`~ds4c.buckets.prefill_chunk_for`) would run next, so a prompt is ingested exactly as it is alone. Decode
  therefore waits at most one chunk per token (``prefill_chunk`` caps the chunks run beside decoding sequences,
  and, below the smallest chunk graph, the verify steps a piece holds (at least one);
  ``prefill_every`` N runs a piece only every N steps while sequences decode, so their mean inter-token latency
  grows by a chunk's time / N); with nothing decoding the chunks run back to back. One prompt is prefilled at a
  time, in arrival order; its sequence takes a slot when its last piece is in.
* **Prompt rows in the lanes step** (``prefill_rows`` P > 0): while sequences decode, the prompt's rows run as one
  more lane of P rows in the decode step itself (:meth:`LanesStep.decode_beside`, the prompt slot), so their next
  token waits one slightly wider step, never a chunk: P of its tokens per step (``prefill_every`` does not apply),
  its first ``rest % P`` tokens on the one-sequence step's verify steps so that every lane piece is whole. With
  nothing decoding, or more decoding sequences than a prompt graph holds, the rest goes back to the chunks. The
  prompt is then ingested by verify-width rows, not by the chunks it gets alone: its logits equal those within the
  one-sequence step's noise floor, not bit for bit.
* **Admission**: a free slot and no other prompt in prefill; else the request waits (first come, first served).
* **Sampling**: the first token on the host from the prompt's last logits (the request's generator, as alone), the
  rest on the device per lane (:meth:`LanesStep.next_tokens`: the one-sequence device loop's rule and noise), so a
  request's tokens are those it gets alone (greedy: the rows are bit-equal, docs/gpu-validation.md).
* **Prefix reuse**: a sequence that ends (not failed) leaves a snapshot of its slot, keyed by the tokens its state
  holds (prompt and fed replies); a prompt that begins with such a key (the next turn of the chat) restores it on
  the one-sequence step and prefills only the rest. At most ``prefix_states`` snapshots and as many bytes as the
  slots themselves, least recently used evicted first. Shared prefixes of different conversations (a common system
  prompt) are not found: the paged pool of the reference keeps those by page; the compiled step has no page table.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ds4c.batch_lane import LaneOut, nonfinite
from ds4c.buckets import MIN_PREFILL_CHUNK, prefill_chunk_for
from ds4c.errors import StepError

#: Verify steps a piece holds when the engine has no chunk graph for the prompt's rest.
VERIFY_STEPS_PER_PIECE = 8


class SlotLanes:
    """Batch steps on the compiled step (module docstring).

    Args:
        step: the one-sequence engine (a :class:`~ds4c.runtime.step.CompiledStep`): prefill, ``reset``,
            ``restore``, ``pos``.
        max_ctx: positions a request may hold (at most the step's).
        config: a :class:`~ds4c.batching.BatchConfig` (``max_lanes``: the slots; ``prefix_states``;
            ``prefill_chunk``; ``warm``).
        lanes: the lanes runner over ``step`` (default: a :class:`~ds4c.runtime.step.lanes.LanesStep` of
            ``max_lanes`` slots).
    """

    name = "compiled"

    def __init__(self, step: Any, max_ctx: int, config: Any, lanes: Any = None):
        if lanes is None:
            from ds4c.runtime.step.lanes import LanesStep  # CUDA only: not on the CPU's import path

            lanes = LanesStep(step, slots=config.max_lanes, prompt_rows=config.prefill_rows)
        if max_ctx > step.max_ctx:
            raise StepError(f"max_ctx {max_ctx} exceeds the compiled step's {step.max_ctx}")
        self.one, self.lanes, self.config, self.cfg = step, lanes, config, step.cfg
        self.order: list[Any] = []  # slot j -> its request
        self.prefilling: Any = None
        self.in_lanes = False  # the prompt in prefill is in the lanes' prompt slot (not on the one-sequence step)
        self.prefix: OrderedDict[tuple[int, ...], dict[str, Any]] = OrderedDict()
        self.hits = self.hit_tokens = 0
        self._since_piece = 0  # steps since the last prefill piece
        self.warm_s = lanes.warm() if config.warm else 0.0

    # ------------------------------------------------------------------------------------------ requests
    def check_request(self, positions: int) -> None:
        """Every request that fits max_ctx fits a slot."""

    def admit(self, req: Any) -> bool:
        """Start ``req``'s prefill on the one-sequence step (from the longest cached prefix of its prompt); False
        while another prompt is in prefill or every slot is taken."""
        if self.prefilling is not None or len(self.order) >= self.lanes.slots:
            return False
        key = self._match(req.prompt)
        if key is None:
            self.one.reset()
            req.reused = 0
        else:
            self.one.restore(self.prefix[key])
            self.prefix.move_to_end(key)
            self.hits += 1
            self.hit_tokens += len(key)
            req.reused = len(key)
        req.fed = list(req.prompt[:req.reused])
        req.seq = "prefill"
        self.prefilling = req
        return True

    def _match(self, prompt: list[int]) -> tuple[int, ...] | None:
        """The longest cached key that the prompt begins with and goes past (a token is left to prefill)."""
        best = None
        for key in self.prefix:
            if len(key) < len(prompt) and (best is None or len(key) > len(best)) and tuple(prompt[:len(key)]) == key:
                best = key
        return best

    def free(self, req: Any, failed: bool = False) -> None:
        """``req`` has ended: its slot to the last sequence's (kept as a prefix snapshot first, unless it failed);
        a prompt cut off in its prefill leaves the one-sequence step to the next admission."""
        if req is self.prefilling:
            self.prefilling = None
            if self.in_lanes:
                self.in_lanes = False
                if self.config.poison:
                    self.lanes.poison(self.lanes.prompt_slot)
            return
        if req not in self.order:
            return
        i, last = self.order.index(req), len(self.order) - 1
        if self.config.prefix_states and not failed and len(req.fed) == self.lanes.pos[i]:
            self._keep(tuple(req.fed), self.lanes.save(i))
        if i != last:
            self.lanes.move(last, i)
            self.order[i] = self.order[last]
        self.order.pop()
        if self.config.poison:  # the vacated slot: a stale read of it shows (the next install overwrites it whole)
            self.lanes.poison(last)
        req.seq = None

    def _keep(self, key: tuple[int, ...], snap: dict[str, Any]) -> None:
        self.prefix.pop(key, None)
        self.prefix[key] = snap
        cap = min(self.config.prefix_states, self.lanes.slots)  # as many bytes as the slots hold
        while len(self.prefix) > cap:
            self.prefix.popitem(last=False)

    # ------------------------------------------------------------------------------------------ the step
    def run(self, active: list[Any]) -> list[LaneOut]:
        """One decode row of every sequence in a slot, then one piece of the prompt in prefill (module
        docstring)."""
        out: list[LaneOut] = []
        req = self.prefilling
        rows = self._lane_rows(req)
        if self.order:
            reqs = list(self.order)
            for r in reqs:
                r.fed.append(r.tokens[-1])
            logits, last = self.lanes.decode_beside([r.tokens[-1] for r in reqs], rows)
            ids = self.lanes.next_tokens(logits)
            out += [LaneOut(r, 1, token=t) for r, t in zip(reqs, ids)]
            if rows is not None:
                out.append(self._lane_piece(req, rows, last))
        if req is not None and rows is None:
            if self.in_lanes:  # nothing decodes any more (or too many do): the rest on the one-sequence step
                self.one.restore(self.lanes.save(self.lanes.prompt_slot))
                self.in_lanes = False
            rest = len(req.prompt) - self.one.pos
            P = self.config.prefill_rows
            if P and self.order and rest % P and self.lanes.prompt_size_for(len(self.order)) is not None:
                out.append(self._piece(req, rest % P))  # the odd rows first: every lane piece is then whole
            else:
                self._since_piece += 1
                if not self.order or self._since_piece >= self.config.prefill_every:
                    self._since_piece = 0
                    out.append(self._piece(req))
        return out

    def _lane_rows(self, req: Any) -> list[int] | None:
        """The prompt rows the next lanes step carries (moving the prompt into the prompt slot first), or None: no
        prompt lane this step (none in prefill, ``prefill_rows`` off, nothing decoding or more than a prompt graph
        holds, or the rows left not a whole number of lane pieces yet)."""
        P = self.config.prefill_rows
        if req is None or not P or not self.order or self.lanes.prompt_size_for(len(self.order)) is None:
            return None
        if not self.in_lanes:
            if (len(req.prompt) - self.one.pos) % P:
                return None
            self.lanes.install(self.lanes.prompt_slot)
            self.in_lanes = True
        pos = self.lanes.pos[self.lanes.prompt_slot]
        return list(req.prompt[pos:pos + P])

    def _lane_piece(self, req: Any, rows: list[int], last: Any) -> LaneOut:
        """The prompt rows of this lanes step are in; the last piece hands the prompt slot to a decode slot."""
        req.fed += rows
        done = self.lanes.pos[self.lanes.prompt_slot]
        if done < len(req.prompt):
            return LaneOut(req, len(rows), done)
        lg = last.float().cpu()
        err = nonfinite(lg, done - 1, done)
        if err is None:
            self._install(req, self.lanes.prompt_slot)
        if self.config.poison:
            self.lanes.poison(self.lanes.prompt_slot)
        self.prefilling, self.in_lanes = None, False
        return LaneOut(req, len(rows), done, lg, None, err)

    def _install(self, req: Any, src: int | None = None) -> None:
        """``req``'s sequence (on the one-sequence step, or in slot ``src``) to the next decode slot, its next
        tokens sampled on the device by its parameters."""
        slot = len(self.order)
        if src is None:
            self.lanes.install(slot)
        else:
            self.lanes.move(src, slot)
        self.lanes.configure(slot, req.temperature, req.top_k, req.top_p, req.seed)
        self.order.append(req)
        req.seq = slot

    def _piece(self, req: Any, limit: int | None = None) -> LaneOut:
        """The next piece of the prompt on the one-sequence step (at most ``limit`` rows: then as verify steps)."""
        one, prompt = self.one, req.prompt
        pos = one.pos
        chunks = tuple(getattr(one, "prefill_chunks", ()) or ()) if limit is None else ()
        if self.order and self.config.prefill_chunk is not None:
            chunks = tuple(c for c in chunks if c <= self.config.prefill_chunk)
        rest, w = len(prompt) - pos, max(one.buckets.widths)
        c = prefill_chunk_for(chunks, rest, pos, one.max_ctx) if chunks else None
        if c is not None:
            n = min(c, rest)
        elif chunks and rest < MIN_PREFILL_CHUNK:
            n = rest  # the tail: verify steps, as the one-sequence prefill runs it
        else:  # verify steps: at most VERIFY_STEPS_PER_PIECE, and within the cap beside decoding sequences
            steps = VERIFY_STEPS_PER_PIECE
            if self.order and self.config.prefill_chunk is not None:
                steps = max(1, min(steps, self.config.prefill_chunk // w))
            n = min(rest, w * steps, limit or rest)
        toks = prompt[pos:pos + n]
        if chunks:
            logits = one.prefill(toks, pos, chunks=chunks)
        else:
            for s in range(0, n, w):
                logits = one.verify(toks[s:s + w], pos + s)
            logits = logits[-1:]
        req.fed += toks
        done = pos + n
        if done < len(prompt):
            return LaneOut(req, n, done)
        lg = logits[-1:].float().cpu()
        err = nonfinite(lg, done - 1, done)
        if err is None:  # the sequence to a slot; its next tokens sampled on the device by its parameters
            self._install(req)
        self.prefilling = None
        return LaneOut(req, n, done, lg, None, err)

    def stats(self, active: list[Any]) -> dict[str, int]:
        """For the server's gauges: a slot counts as a page of the step's capacity (``pages_running``: slots of
        running sequences; ``prefix_pages``: cached prefix snapshots)."""
        return {"pages_in_use": len(self.order) + len(self.prefix), "pages_running": len(self.order),
                "pages": self.lanes.slots, "page_tokens": self.one.max_ctx, "prefix_pages": len(self.prefix),
                "prefix_hits": self.hits, "prefix_hit_tokens": self.hit_tokens}

    def clear_prefixes(self) -> None:
        """Drop the prefix snapshots."""
        self.prefix.clear()

    def close(self) -> None:
        """Drop the prefix snapshots."""
        self.clear_prefixes()
