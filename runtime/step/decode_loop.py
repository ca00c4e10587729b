"""The compiled step's host-free decode loop: per q = 1 context bucket one CUDA graph of the step followed by the
device sampler (:class:`~ds4c.runtime.sampler.DeviceSampler`: greedy, or temperature / top-k / top-p with seeded
counter-based noise), which writes the sampled id into the next step's token slot and moves the step scalars on;
the host replays one graph per token and reads the ids back a few steps behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ds4c.buckets import BucketSpec
from ds4c.errors import StepError
from ds4c.runtime.sampler import DeviceSampler
from ds4c.runtime.step.binding import StepGraph
from ds4c.runtime.step.graphs import StepGraphs
from ds4c.runtime.step.scalars import StepScalars
from ds4c.runtime.step.sequence import StepSequence


class DecodeLoop:
    """Device sampling and the decode loop of one compiled step (or shard).

    Args:
        graphs, scalars, sequence: the step's parts.
        prepare: ``(width, context) -> StepGraph``, the step's graph of a key (``CompiledStep.prepare``).
        cfg, buckets: the model's config and the buckets served.
        is_last: the step samples (a shard before the last only advances its scalars: mode ``advance``).
        split: the step is a shard of a layer split (:meth:`decode_tokens` then refuses: ``ShardedStep`` drives it).
        use_graphs: the step replays CUDA graphs (:meth:`decode_tokens` needs them).
        dev: the step's CUDA device.

    Attributes: ``graphs`` (the decode graphs by (context, mode)), ``token_sinks`` (where the sampler also writes
    each id: the token slots of the other shards of a split on this device; set before the decode graphs are
    captured), ``modes`` (the decode graphs captured per q = 1 bucket), ``ring_host`` (the pinned copy of the
    sampler's id ring and one event per slot, once :meth:`sampler` made it).
    """

    def __init__(self, graphs: StepGraphs, scalars: StepScalars, sequence: StepSequence,
                 prepare: Callable[[int, int], StepGraph], cfg: Any, buckets: BucketSpec, is_last: bool, split: bool,
                 use_graphs: bool, dev: torch.device):
        self.step_graphs, self.scalars, self.sequence, self.prepare = graphs, scalars, sequence, prepare
        self.cfg, self.buckets, self.split, self.use_graphs, self.dev = cfg, buckets, split, use_graphs, dev
        self.token_sinks: list[torch.Tensor] = []
        self.modes = ("greedy", "sample") if is_last else ("advance",)
        self._sampler: DeviceSampler | None = None
        self.ring_host: tuple[torch.Tensor, list[Any]] | None = None
        self._bodies: dict[str, Any] = {}
        self.graphs: dict[tuple[int, str], Any] = {}

    def decode_tokens(self, token: int, pos: int, n: int, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int = 0, lag: int = 4) -> Iterator[int]:
        """Decode ``n`` tokens after ``token`` (at ``pos``) with sampling on the device, host-free
        (``CompiledStep.decode_tokens``). Yields the ids in order.

        Raises:
            StepError: ``pos`` is not the sequence's next position, positions past ``max_ctx``, ``use_graphs``
                off, a shard of a split.
        """
        if not self.use_graphs:
            raise StepError("decode_tokens needs use_graphs=True")
        if self.split:
            raise StepError("decode_tokens runs an unsplit step; a layer split's shards are driven by ShardedStep")
        if pos != self.sequence.pos:
            raise StepError(f"step at position {pos}, but the sequence's next position is {self.sequence.pos}")
        if pos + n > self.buckets.max_ctx:
            raise StepError(f"positions {pos}..{pos + n - 1} exceed max_ctx={self.buckets.max_ctx}")
        if n <= 0:
            return
        lag = max(1, min(int(lag), 32))
        mode = "greedy" if temperature == 0 else "sample"
        with torch.cuda.device(self.dev):
            sampler = self.sampler()
            sampler.configure(temperature, top_k, top_p, seed)
            ring = sampler.ring_size
            host, done = self.ring_host
            contexts = [self.buckets.bucket(pos + i, 1) for i in range(n)]
            graphs = {c: self.graph(c, mode) for c in sorted(set(contexts))}  # captured by prepare_all
            graphs = [graphs[c] for c in contexts]
            self.scalars.upload([token], pos)
        launched = consumed = 0
        try:
            while consumed < n:
                with torch.cuda.device(self.dev):  # not held across the yield: the caller's device is its own
                    while launched < n and launched - consumed < lag:
                        graphs[launched].replay()
                        slot = launched % ring
                        host[slot:slot + 1].copy_(sampler.ring[slot:slot + 1], non_blocking=True)
                        done[slot].record()
                        launched += 1
                    slot = consumed % ring
                    done[slot].synchronize()
                consumed += 1
                yield int(host[slot])
        finally:
            self.sequence.advance(pos + launched)

    def sampler(self) -> DeviceSampler:
        """The step's device sampler (made on first use, with the pinned host copy of its id ring)."""
        if self._sampler is None:
            self._sampler = DeviceSampler(self.cfg.vocab_size, self.dev, ring=64)
            # where the ids come back: a pinned copy of the ring and one event per slot (allocated once:
            # pinning memory costs milliseconds)
            self.ring_host = (torch.zeros(64, dtype=torch.int64).pin_memory(),
                              [torch.cuda.Event() for _ in range(64)])
        return self._sampler

    def _body(self, mode: str) -> Any:
        """The sampler + advance operations of ``mode`` (``greedy`` or ``sample``) as a closure to capture: reads
        logits row 0, writes the id to the ring and the next step's token slot (and to every tensor of
        :attr:`token_sinks`: the token slots of the other shards of a split on this device), and moves the step
        scalars one position on (``pos``, ``live_r`` = (pos + 1) // r, ``positions[0]``). Mode ``advance`` (a
        shard before the last of a split) only moves the scalars on. Run once eagerly on first use
        (allocator, kernels), its effects undone."""
        body = self._bodies.get(mode)
        if body is not None:
            return body
        sampler = self.sampler() if mode != "advance" else None
        d, off, ratios = self.scalars.buffer, self.scalars.offsets, self.scalars.ratios
        logits = self.step_graphs.logits
        sinks = list(self.token_sinks)
        head = torch.tensor([off["pos"]] + [off[f"live_r{r}"] for r in ratios] + [off["positions"]],
                            dtype=torch.int64, device=self.dev)
        add = torch.tensor([1] + [2] * len(ratios) + [1], dtype=torch.int64, device=self.dev)
        div = torch.tensor([1] + list(ratios) + [1], dtype=torch.int64, device=self.dev)

        def body() -> None:
            # pos' = pos + 1, live_r = (pos' + 1) // r, positions[0] = pos': one vector op from the old pos
            if mode == "advance":
                d.index_copy_(0, head, torch.div(d[off["pos"]] + add, div, rounding_mode="floor"))
                return
            tok = sampler.greedy(logits[0]) if mode == "greedy" else sampler.sample(logits[0])
            d.index_copy_(0, head, torch.div(d[off["pos"]] + add, div, rounding_mode="floor"))
            d[off["tokens"]:off["tokens"] + 1].copy_(tok)
            for t in sinks:
                t.copy_(tok)

        keep = [d] + sinks + ([] if sampler is None else [sampler.counter, sampler.ring])
        saved = [t.clone() for t in keep]
        side = torch.cuda.Stream(self.dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for t, v in zip(keep, saved):
            t.copy_(v)
        self._bodies[mode] = body
        return body

    def graph(self, context: int, mode: str) -> Any:
        """One CUDA graph of a decode step in bucket ``context`` followed by the sampler of ``mode``
        (:meth:`_body`): what :meth:`decode_tokens` replays once per token. Capturing records without running, so
        it leaves the sequence as it was."""
        g = self.graphs.get((context, mode))
        if g is not None:
            return g
        sg = self.prepare(1, context)
        body = self._body(mode)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.step_graphs.pool):
            self.step_graphs.run(sg)
            body()
        torch.cuda.synchronize()
        self.graphs[(context, mode)] = g
        self.step_graphs.captures += 1
        return g
