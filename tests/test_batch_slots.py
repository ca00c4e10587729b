"""The compiled step's batch backend (:class:`ds4c.batch_slots.SlotLanes`) on the CPU: its scheduling, slots,
compaction, prefix snapshots and per-lane sampling, driven over the reference.

SlotLanes drives two things: a one-sequence engine (prompts prefilled piece by piece) and a lanes runner over
sequence slots (:class:`ds4c.runtime.step.lanes.LanesStep` on a GPU). Here the one-sequence engine is the reference
itself and :class:`RefSlots` is a lanes runner with LanesStep's interface over the reference's ``step_lanes`` (slots
of :class:`SequenceState`, the same per-slot :class:`DeviceSampler` on CPU tensors). What LanesStep itself computes
is checked on the GPU (tests/test_lanes_gpu.py); what is checked here is everything SlotLanes decides: which
request runs in which slot, what is fed when, when a sequence moves, what a prefix snapshot holds, which sampler
draws each token. A vacated slot is dropped (None), so a read of it fails the step.

The reference is row-invariant, so every comparison is bit for bit: a request's tokens equal the one-sequence
compiled loop's rule run alone (prompt as verify steps; the first token drawn on the host with the request's
generator, the rest by a device sampler seeded with the request's seed: ``ds4c.generate`` with a
``DeviceLoop`` engine).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ds4c.batch_slots import SlotLanes
from ds4c.batching import BatchConfig, BatchEngine
from ds4c.errors import StepError
from ds4c.generate import generate
from ds4c.reference import Reference
from ds4c.reference.primitives import sample
from ds4c.runtime.sampler import DeviceSampler
from ds4c.sampling import filter_logits

MAX_CTX = 320


class RefOne:
    """The one-sequence engine SlotLanes prefills on: the reference (verify steps of width 1..5, no chunks)."""

    prefill_chunks = ()
    buckets = SimpleNamespace(widths=(1, 2, 3, 4, 5))

    def __init__(self, ref: Reference):
        self.ref, self.cfg, self.max_ctx = ref, ref.cfg, ref.max_ctx
        self.restores = 0

    @property
    def pos(self) -> int:
        return self.ref.pos

    def reset(self) -> None:
        self.ref.reset()

    def restore(self, snap) -> None:
        self.restores += 1
        self.ref.restore(snap)

    def verify(self, tokens, pos):
        return self.ref.verify(tokens, pos)


class RefSlots:
    """A lanes runner with :class:`~ds4c.runtime.step.lanes.LanesStep`'s interface over the reference (module
    docstring)."""

    def __init__(self, one: RefOne, slots: int, prompt_rows: int = 0, beside: int = 16):
        self.one, self.ref, self.slots = one, one.ref, slots
        self.prompt_rows, self.beside = prompt_rows, beside  # a prompt lane beside at most ``beside`` decode lanes
        self.prompt_slot = slots if prompt_rows else None
        self.seqs: list = [None] * (slots + bool(prompt_rows))
        self.pos = [0] * len(self.seqs)
        self.samplers = [DeviceSampler(one.cfg.vocab_size, "cpu") for _ in range(slots)]
        self.temperature = [0.0] * slots
        self.decoded: list[int] = []  # lanes per decode step
        self.prompt_steps: list[int] = []  # decode lanes beside each prompt lane

    def warm(self) -> float:
        return 0.0

    def install(self, slot: int) -> None:
        self.seqs[slot] = self.ref.snapshot()
        self.pos[slot] = self.ref.pos

    def configure(self, slot, temperature, top_k, top_p, seed) -> None:
        self.samplers[slot].configure(temperature, top_k, top_p, seed)
        self.temperature[slot] = float(temperature)

    def move(self, src: int, dst: int) -> None:
        assert dst != self.prompt_slot
        self.seqs[dst] = self.seqs[src]
        self.pos[dst] = self.pos[src]
        if src == self.prompt_slot:  # no sampler: SlotLanes configures the slot
            self.seqs[src] = None  # as if poisoned: the prompt slot is read again only after an install
            return
        a, b = self.samplers[src], self.samplers[dst]
        for k in ("temperature", "top_k", "top_p", "seed", "counter"):
            getattr(b, k).copy_(getattr(a, k))
        self.temperature[dst] = self.temperature[src]

    def prompt_size_for(self, lanes: int):
        return lanes if self.prompt_rows and lanes <= self.beside and lanes < self.slots else None

    def poison(self, slot: int) -> None:
        self.seqs[slot] = None

    def save(self, slot: int):
        return self.seqs[slot].snapshot()

    def decode(self, tokens: list[int]) -> torch.Tensor:
        return self.decode_beside(tokens)[0]

    def decode_beside(self, tokens: list[int], prompt=None):
        n = len(tokens)
        self.decoded.append(n)
        lanes = [(self.seqs[j], [t], self.pos[j]) for j, t in enumerate(tokens)]
        if prompt is not None:
            assert len(prompt) == self.prompt_rows and self.prompt_size_for(n) is not None
            self.prompt_steps.append(n)
            lanes.append((self.seqs[self.prompt_slot], list(prompt), self.pos[self.prompt_slot]))
        rows = self.ref.step_lanes(lanes)
        for j in range(n):
            self.pos[j] += 1
        if prompt is None:
            return torch.cat(rows), None
        self.pos[self.prompt_slot] += len(prompt)
        return torch.cat(rows[:n]), rows[n][-1:]

    def next_tokens(self, logits: torch.Tensor) -> list[int]:
        ids = logits.argmax(dim=-1)
        for j in range(logits.shape[0]):
            if self.temperature[j] > 0:
                ids[j:j + 1] = self.samplers[j].sample(logits[j])
        return ids.tolist()


@pytest.fixture(scope="module")
def ref(tiny_weights):
    return Reference(tiny_weights, max_ctx=MAX_CTX)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(ref: Reference, slots: int, beside: int = 16, **kw) -> tuple[BatchEngine, RefSlots]:
    cfg = BatchConfig(max_lanes=slots, max_rows=16, **kw)
    one = RefOne(ref)
    lanes = RefSlots(one, slots, cfg.prefill_rows, beside)
    return BatchEngine(ref, MAX_CTX, cfg, backend=SlotLanes(one, MAX_CTX, cfg, lanes)), lanes


def alone(ref: Reference, prompt: list[int], n: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
          seed: int = 0, stop_ids=()) -> list[int]:
    """The compiled one-sequence loop's rule (module docstring), on the reference."""
    ref.reset()
    for s in range(0, len(prompt), 5):
        logits = ref.verify(prompt[s:s + 5], s)
    rng = torch.Generator().manual_seed(seed)
    tok = int(sample(filter_logits(logits[-1:].float(), temperature, top_k, top_p), temperature, rng)[0])
    dev = DeviceSampler(ref.cfg.vocab_size, "cpu")
    dev.configure(temperature, top_k, top_p, seed)
    out = [tok]
    while tok not in stop_ids and len(out) < n:
        row = ref.decode(tok, len(prompt) + len(out) - 1)[0]
        tok = int(dev.sample(row)[0]) if temperature > 0 else int(row.argmax())
        out.append(tok)
    return out


def test_slots_equal_each_request_alone(ref):
    """Three slots, five requests joining and leaving at different positions (window wraps, every flush, 64
    tokens for the longest), greedy and seeded sampling (top-k, top-p), a stop id, one cancelled in its prompt, one
    waiting for a slot, one chat turn from a finished request's snapshot: each request's tokens equal the same
    request alone (greedy ones also ``ds4c.generate``'s), sequences move when one leaves, a vacated slot is never
    read, and the step holds one decode row per running sequence."""
    a_p, b_p, c_p = ids(21, 10), ids(40, 11), ids(7, 12)
    kw_b, kw_c = dict(temperature=0.7, top_p=0.9, seed=1), dict(temperature=0.9, top_k=40, seed=3)
    want_a = alone(ref, a_p, 64)
    assert want_a[:12] == generate(ref, a_p, 12).tokens  # the rule alone is generate's for greedy
    want_b = alone(ref, b_p, 48, **kw_b)
    eos = want_b[36]  # with it as a stop id, the same draws end at its first occurrence (alone's loop keeps it)
    want_b = want_b[:want_b.index(eos) + 1]
    want_c = alone(ref, c_p, 40, **kw_c)
    eng, lanes = engine(ref, 3, poison=True)
    a = eng.submit(a_p, 64)
    b = eng.submit(b_p, 48, stop_ids=(eos,), **kw_b)
    halt = threading.Event()  # the third slot's prompt: cancelled after its first piece (of 40 tokens)
    doomed = eng.submit(ids(90, 14), 10, cancel=halt, on_prefill=lambda done, total: halt.set())
    for _ in range(5):
        next(a)
    c = eng.submit(c_p, 40, **kw_c)
    rb = b.run()
    assert rb.tokens == want_b and rb.stop_reason == "eos"
    turn2 = b_p + rb.tokens + ids(6, 15)  # the next turn of b's chat: starts from b's snapshot
    want_t2 = alone(ref, turn2, 16)
    t2 = eng.submit(turn2, 16)
    assert a.run().tokens == want_a and c.run().tokens == want_c
    assert t2.run().tokens == want_t2 and t2.prefix_reused == len(b_p) + len(rb.tokens) - 1
    assert doomed.stop().stop_reason == "stop" and doomed.run().tokens == []
    st = eng.stats()
    assert st["running"] == 0 and st["pages_running"] == 0 and st["prefix_hits"] == 1
    assert max(lanes.decoded) == 3 and min(lanes.decoded) == 1  # sequences decoded together, then alone
    assert lanes.seqs == [None] * 3  # every sequence left its slot, each vacated slot dropped
    eng.close()


def test_slot_admission_and_prefix_snapshots(ref):
    """One prompt in prefill at a time; a full set of slots is a wait; the snapshots kept are at most the slots,
    least recently used dropped; a prompt equal to a snapshot's key (nothing left to prefill) does not use it."""
    eng, lanes = engine(ref, 2)
    first = [eng.submit(ids(12, 20 + k), 4) for k in range(3)]
    outs = [r.run() for r in first]
    # the second is admitted once the first's prompt is in (its first token out); the third once a slot is free
    assert first[1].t_admit > first[0].t_first
    assert first[2].t_admit > min(first[0].t_last, first[1].t_last)
    assert [o.tokens for o in outs] == [alone(ref, ids(12, 20 + k), 4) for k in range(3)]
    keys = list(eng.backend.prefix)
    assert len(keys) == 2 and keys[-1] == tuple(first[2].fed)  # three ended, two kept: the oldest dropped
    same = eng.submit(list(keys[-1]), 3)  # all of it cached: a token must be left to prefill
    assert same.run().tokens == alone(ref, list(keys[-1]), 3) and same.prefix_reused == 0
    eng.clear_prefixes()
    assert eng.stats()["prefix_pages"] == 0
    eng.close()


def test_batch_engine_refuses_what_slots_cannot_run(ref):
    """A compiled step the batch cannot drive (a split, taps, final-HC recording) and a max_ctx past the step's are
    one-line errors."""
    from ds4c.batching import lanes_backend

    split = SimpleNamespace(is_split=True, taps=(), record_hc=False)
    with pytest.raises(StepError, match="unsplit compiled step without DSpark taps"):
        lanes_backend(split, 64, BatchConfig())
    taps = SimpleNamespace(is_split=False, taps=(1,), record_hc=False)
    with pytest.raises(StepError, match="unsplit compiled step without DSpark taps"):
        lanes_backend(taps, 64, BatchConfig())
    one = RefOne(ref)
    with pytest.raises(StepError, match="max_ctx 400 exceeds the compiled step's 320"):
        SlotLanes(one, 400, BatchConfig(), RefSlots(one, 2))
    with pytest.raises(StepError, match="prefill_chunk must be an int >= 1 or None"):
        BatchConfig(prefill_chunk=0).check()


def test_prefill_every_spaces_the_pieces_beside_decoding(ref):
    """``prefill_every=3``: while a sequence decodes, a prompt's pieces run every third step (and its tokens are
    still the alone ones); with nothing decoding they run every step."""
    eng, lanes = engine(ref, 2, prefill_every=3)
    at: list[int] = []
    a = eng.submit(ids(5, 30), 40)
    next(a)
    b = eng.submit(ids(100, 31), 4, on_prefill=lambda done, total: at.append(eng.steps))
    assert b.run().tokens == alone(ref, ids(100, 31), 4) and a.run().tokens == alone(ref, ids(5, 30), 40)
    assert len(at) == 3 and all(y - x == 3 for x, y in zip(at, at[1:]))  # 40 + 40 + 20 tokens, 3 steps apart
    at.clear()
    c = eng.submit(ids(100, 32), 2, on_prefill=lambda done, total: at.append(eng.steps))
    c.run()
    assert len(at) == 3 and all(y - x == 1 for x, y in zip(at, at[1:]))
    eng.close()


def test_prompt_rows_in_the_lanes_step_equal_each_request_alone(ref):
    """``prefill_rows=5``: a prompt arriving while sequences decode runs as a 5-row lane of their decode step (its
    first ``rest % 5`` tokens on the one-sequence step first), then takes a decode slot; with nothing decoding, or
    more decoding than a prompt graph holds (here 1), it goes back to the one-sequence step. Every request's tokens
    equal the same request alone (greedy and sampled, a chat turn from a snapshot), and no decode step waits for a
    prompt piece on the one-sequence step while a prompt lane fits."""
    a_p, b_p, c_p = ids(12, 30), ids(47, 31), ids(33, 32)
    kw_b = dict(temperature=0.8, top_k=50, seed=4)
    want_a, want_b, want_c = alone(ref, a_p, 60), alone(ref, b_p, 30, **kw_b), alone(ref, c_p, 8)
    eng, lanes = engine(ref, 3, beside=1, poison=True, prefill_rows=5)
    a = eng.submit(a_p, 60)
    next(a)  # a decodes alone: b's 47 tokens go 2 on the one-sequence step, then 9 lane pieces beside a
    b = eng.submit(b_p, 30, **kw_b)
    assert b.run().tokens == want_b
    assert lanes.prompt_steps[:9] == [1] * 9 and len(lanes.prompt_steps) == 9
    # c arrives beside a and b (2 decoding: more than a prompt graph holds here): its pieces on the one-sequence
    # step; once b has ended and a decodes alone, a prompt lane again (33 tokens: 3 + 6 lane pieces at most)
    c = eng.submit(c_p, 8)
    assert c.run().tokens == want_c and a.run().tokens == want_a
    turn2 = a_p + want_a + ids(9, 33)  # a chat's next turn from a's snapshot, nothing else decoding
    assert eng.submit(turn2, 6).run().tokens == alone(ref, turn2, 6)
    st = eng.stats()
    assert st["running"] == 0 and st["prefix_hits"] == 1
    assert lanes.seqs == [None] * 4  # every slot vacated and dropped, the prompt slot too
    eng.close()


def test_prompt_lane_goes_back_to_the_one_sequence_step_when_decoding_ends(ref):
    """A prompt in the prompt lane whose only decoding neighbour ends mid-prompt: its state moves back to the
    one-sequence step (a restore of the prompt slot) and the rest is prefilled there; its tokens equal alone."""
    a_p, b_p = ids(9, 40), ids(80, 41)
    want_b = alone(ref, b_p, 5)
    eng, lanes = engine(ref, 2, prefill_rows=5)
    a = eng.submit(a_p, 4)
    next(a)
    b = eng.submit(b_p, 5)
    assert b.run().tokens == want_b and a.run().tokens == alone(ref, a_p, 4)
    assert 1 <= len(lanes.prompt_steps) < 16 and eng.backend.one.restores == 1
    eng.close()


def test_a_prompt_cancelled_in_the_prompt_lane_leaves_its_slot_poisoned(ref):
    """A prompt cancelled while its rows run in the prompt lane: it ends with no tokens, its prompt slot is dropped
    (poisoned), the decoding neighbour is untouched (equal to alone) and the next prompt beside it runs in the
    prompt lane from a fresh install and equals alone."""
    a_p, b_p, c_p = ids(9, 50), ids(60, 51), ids(23, 52)
    eng, lanes = engine(ref, 3, poison=True, prefill_rows=5)
    a = eng.submit(a_p, 40)
    next(a)
    halt = threading.Event()
    pieces = []

    def on_prefill(done, total):
        pieces.append(done)
        if len(pieces) == 3:  # a few lane pieces in
            halt.set()

    b = eng.submit(b_p, 5, cancel=halt, on_prefill=on_prefill)
    assert b.run().tokens == [] and b.result.stop_reason == "stop"
    assert lanes.seqs[lanes.prompt_slot] is None and len(lanes.prompt_steps) >= 2
    c = eng.submit(c_p, 6)
    assert c.run().tokens == alone(ref, c_p, 6) and a.run().tokens == alone(ref, a_p, 40)
    eng.close()


def test_prefill_rows_checked():
    for bad in (-1, 6, 2.0, True):
        with pytest.raises(StepError, match="prefill_rows"):
            BatchConfig(prefill_rows=bad).check()
