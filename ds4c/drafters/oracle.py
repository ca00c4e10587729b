"""The oracle drafter: drafts the target's own greedy continuation at a chosen acceptance rate (``--draft
oracle:ALPHA[:SEP]``), a benchmark of the speculative loop (:mod:`ds4c.speculative`), since synthetic weights make any
trained-style drafter's acceptance near zero. Its continuation is an autoregressive pass of the generation loop
(:func:`ds4c.generate.generate`) before the request.
"""

from __future__ import annotations

import math
import random

from ds4c.engine_protocol import NO_NEEDS, Engine
from ds4c.errors import StepError
from ds4c.generate import generate


class OracleDrafter:
    """Drafts the target's greedy continuation of the prompt, each token kept with probability ``alpha`` and
    otherwise replaced by another id (uniform over the rest of the vocabulary), from ``random.Random(seed)``.

    With greedy decoding the target follows that continuation, so ``alpha`` is the per-token acceptance; with
    sampling the output leaves it after the first sampled difference and the drafts are then mostly rejected.

    ``sep`` (>= 0, optional) emulates a confidence head of known informativeness: after each proposal
    :attr:`confidence` holds, per draft, ``sigmoid(z)`` with ``z`` drawn from ``N(+sep/2, 1)`` when the draft is the
    continuation's token and from ``N(-sep/2, 1)`` when it is not (its own ``random.Random``, seeded from
    ``seed``), so ``logit(alpha) + sep * z`` is the exact log-odds of a right draft (``sep = 0``: a useless head).
    Without ``sep``, :attr:`confidence` stays None (a drafter without a head).

    Raises:
        StepError: ``alpha`` not in [0, 1], ``sep`` not a finite number >= 0 (one line).
    """

    host_only = True
    """Its proposals are list lookups on the host (the pipelined loop may run it while a step is queued)."""
    needs = NO_NEEDS
    """It reads nothing of the target but its greedy continuation (an autoregressive pass at :meth:`prepare`)."""

    def __init__(self, alpha: float, vocab_size: int, seed: int = 0, continuation: list[int] | None = None,
                 sep: float | None = None):
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0.0 <= float(alpha) <= 1.0):
            raise StepError(f"oracle drafter: ALPHA must be a number in [0, 1], found {alpha!r}")
        if sep is not None and (isinstance(sep, bool) or not isinstance(sep, (int, float))
                                or not 0.0 <= float(sep) < float("inf")):
            raise StepError(f"oracle drafter: SEP (confidence separation) must be a finite number >= 0, found {sep!r}")
        self.alpha, self.vocab_size, self.seed = float(alpha), int(vocab_size), int(seed)
        self.sep = None if sep is None else float(sep)
        self.name = f"oracle:{self.alpha:g}" + ("" if self.sep is None else f":{self.sep:g}")
        self._given = None if continuation is None else [int(t) for t in continuation]
        self._continuation: list[int] = []
        self._prompt_len = 0
        self._rng = random.Random(seed)
        self._conf_rng = random.Random(f"{seed}:confidence")
        self.confidence: list[float] | None = None

    @property
    def has_confidence(self) -> bool:
        """It reports a confidence per draft (made with ``sep``)."""
        return self.sep is not None

    def prepare(self, stepper: Engine, prompt: list[int], max_new_tokens: int) -> None:
        """The target's greedy continuation of ``prompt`` (an autoregressive pass on ``stepper``), unless the
        drafter was made with a ``continuation`` (for benchmarks that already ran it)."""
        if self._given is not None:
            self._continuation = self._given
        else:
            self._continuation = generate(stepper, prompt, max_new_tokens).tokens if max_new_tokens else []
        self._prompt_len = len(prompt)
        self._rng = random.Random(self.seed)
        self._conf_rng = random.Random(f"{self.seed}:confidence")
        self.confidence = None

    def propose(self, context: list[int], k: int) -> tuple[list[int], None]:
        at = len(context) - self._prompt_len
        out, conf = [], []
        for i in range(k):
            j = at + i
            t = self._continuation[j] if j < len(self._continuation) else 0
            right = self._rng.random() < self.alpha
            if not right:
                t = (t + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size
            out.append(t)
            if self.sep is not None:
                z = self._conf_rng.gauss(self.sep / 2 if right else -self.sep / 2, 1.0)
                conf.append(1.0 / (1.0 + math.exp(-z)))
        self.confidence = conf if self.sep is not None else None
        return out, None
