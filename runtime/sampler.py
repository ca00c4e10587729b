"""Token sampling on the device, as fixed-shape torch operations a CUDA graph can capture (spec P12).

The same rule as the CPU sampler (:func:`ds4c.reference.primitives.sample` after
:func:`ds4c.sampling.filter_logits`): greedy is the argmax (ties to the lower id); otherwise the logits are
divided by the temperature, filtered by top-k (keep the tokens whose logit is at least the k-th largest) then
top-p (the smallest most-probable set whose mass reaches p, at least one token), and the token is
``argmax(p / E)`` with ``E`` i.i.d. Exp(1) noise, which draws from ``p``. Only the noise source differs: here it
is a counter-based hash of (seed, draw counter, token id) computed on the device, so a replayed graph draws
fresh, reproducible noise with no host involvement. The two samplers are therefore equal in distribution, not
token for token (tests/test_sampler.py checks the distributions).

Every parameter (temperature, top-k, top-p, seed) lives in a device tensor the captured graph reads, so one
capture serves every request; :meth:`DeviceSampler.configure` writes them between requests.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (murmur3's finalizer) on int64 tensors holding values in [0, 2^32): the int64
    products wrap, but their low 32 bits, all that is kept, are exact."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def argmax_chunk(vocab: int) -> int | None:
    """The chunk length :func:`argmax_rows` splits a row of ``vocab`` logits into: the largest divisor of
    ``vocab`` in 64..2048 that leaves at least 32 chunks, or None (then a plain argmax)."""
    for c in range(min(2048, vocab // 32), 63, -1):
        if vocab % c == 0:
            return c
    return None


def argmax_rows(x: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Per-row argmax of ``x`` (fp32 [R, V]; ties to the lower id, as ``torch.argmax``) in two levels: the max
    of each ``chunk`` of a row, then the first chunk holding the row's max. One torch reduction over [R, V]
    runs few blocks for small R (38 us for 5 x 129280 on the H200, measured); the chunked form spreads
    R * V / chunk reductions over the GPU. Returns int64 [R] (on x's device)."""
    r, v = x.shape
    if chunk is None or v % chunk:
        return x.argmax(dim=-1)
    best, at = x.view(r, v // chunk, chunk).max(dim=-1)  # [R, n]: each chunk's max and its first index
    j = best.argmax(dim=-1, keepdim=True)  # the first chunk with the row's max: the lowest id among ties
    return (j * chunk + at.gather(1, j)).squeeze(1)


def exp_noise(seed: torch.Tensor, counter: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise ``-log(u)`` with ``u`` uniform in (0, 1) from a hash of (seed, counter, id).

    Args:
        seed, counter: int64 [1] device tensors; ids: int64 [V] (0..V-1).
    Returns:
        fp32 [V], > 0.
    """
    h = _mix32(seed * 0x9E3779B1 + counter)
    h = _mix32(h * 0x27D4EB2F + ids * 0x165667B1 + 0x61C88647)
    u = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)
    return (-torch.log(u)).to(torch.float32)


class DeviceSampler:
    """Samples one token from a logits row on its device, writing the id where the next step reads it.

    Args:
        vocab: the vocabulary size V.
        device: where the logits live.
        ring: how many sampled ids the ring buffer keeps (the host reads them back a few steps behind).

    Attributes (device tensors a captured graph reads and writes):
        temperature (fp32 [1]), top_k (int64 [1], 0 = off), top_p (fp32 [1]), seed (int64 [1]),
        counter (int64 [1]: draws so far), ring (int64 [ring]: the id of draw ``n`` at ``n % ring``).
    """

    def __init__(self, vocab: int, device: torch.device | str, ring: int = 64):
        dev = torch.device(device)
        self.vocab, self.device, self.ring_size = int(vocab), dev, int(ring)
        self.temperature = torch.zeros(1, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(1, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(1, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(1, dtype=torch.int64, device=dev)
        self.counter = torch.zeros(1, dtype=torch.int64, device=dev)
        self.ring = torch.zeros(self.ring_size, dtype=torch.int64, device=dev)
        self._first = torch.zeros(self.vocab, dtype=torch.bool, device=dev)  # the most probable token: kept
        self._first[0] = True

    def configure(self, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        """Set a request's parameters and restart the draw counter (host-to-device copies; call between
        replays, never inside a capture). Validation is :func:`ds4c.generate.check_sampling`'s."""
        self.temperature.fill_(float(temperature))
        self.top_k.fill_(int(top_k))
        self.top_p.fill_(float(top_p))
        self.seed.fill_(int(seed) & _M32)
        self.counter.zero_()

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The argmax of fp32 ``logits`` [V] (ties to the lower id), recorded in the ring. Returns int64 [1]."""
        tok = torch.argmax(logits).reshape(1)
        self._record(tok)
        return tok

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """A draw from ``logits`` [V] with the configured temperature (> 0), top-k and top-p, recorded in the
        ring. Returns int64 [1]. Fixed shapes and no host synchronisation: capturable."""
        return self._draw(logits)[0]

    def sample_with_probs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample`, and the distribution the id was drawn from: fp32 [V] in vocabulary order (zero outside
        the top-k / top-p set). What a drafter returns as ``q`` for the exact acceptance rule (the DSpark drafter's
        device sampling, runtime/dspark_exec.py). Capturable."""
        tok, p, order = self._draw(logits)
        return tok, torch.zeros_like(p).scatter_(0, order, p)

    def _draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draw of :meth:`sample`: ``(id int64 [1], p fp32 [V] in sorted order, order int64 [V])``."""
        x = logits.to(torch.float32) / self.temperature
        sx, order = torch.sort(x, descending=True, stable=True)
        k = torch.where(self.top_k > 0, torch.clamp(self.top_k, max=self.vocab), self.vocab)
        kth = torch.gather(sx, 0, k - 1)
        keep_sorted = sx >= kth                                   # top-k, ties at the boundary kept
        sx = sx.masked_fill(~keep_sorted, float("-inf"))
        p = torch.softmax(sx, dim=0)
        before = torch.cumsum(p, dim=0) - p                       # mass of the more probable tokens
        keep_sorted = keep_sorted & ((before < self.top_p) | self._first)
        p = torch.softmax(sx.masked_fill(~keep_sorted, float("-inf")), dim=0)
        noise = exp_noise(self.seed, self.counter, order)         # noise per token id, wherever it sorts
        tok = torch.gather(order, 0, torch.argmax(p / noise).reshape(1))
        self._record(tok)
        return tok, p, order

    def _record(self, tok: torch.Tensor) -> None:
        self.ring.index_copy_(0, self.counter % self.ring_size, tok)
        self.counter.add_(1)
