"""The bucket set: which step graphs exist (spec of the shapes shared by the passes and the runtime).

A step graph is keyed by (width q, context bucket). Widths are the verify widths compiled (1 = decode).
Context buckets are increasing context capacities ``C_b`` (tokens); a step whose last row is at position
``pos + q - 1`` uses the smallest bucket with ``pos + q <= C_b``. In that graph every growing span has a
static capacity: ``C_b // ratio`` compressed rows for each compressing ratio (HCA rows, CSA candidate rows,
indexer keys) and ``min(index_topk, C_b // 4)`` selected rows; live lengths are inputs.

Buckets are data: a :class:`BucketSpec` is validated against the config when built and hashed into the
artifact manifest.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from ds4c.config import MAX_WIDTH, Ds4Config
from ds4c.errors import ConfigError, StepError


@dataclass(frozen=True)
class BucketSpec:
    """Widths and context buckets of the compiled step graphs.

    Attributes:
        widths: verify widths, each in 1..5, increasing.
        contexts: context capacities in tokens, increasing; each a multiple of every compress ratio of the
            config, the last >= ``max_ctx``.
        max_ctx: the largest context the artifact serves.
    """

    widths: tuple[int, ...]
    contexts: tuple[int, ...]
    max_ctx: int

    @classmethod
    def build(cls, cfg: Ds4Config, widths: tuple[int, ...] | list[int] = (1, 2, 3, 4, 5), max_ctx: int = 4096,
              contexts: tuple[int, ...] | list[int] | None = None) -> "BucketSpec":
        """Validated spec; ``contexts`` defaults to powers of two from the smallest multiple of every ratio
        (at least 256 tokens) up to ``max_ctx`` rounded up to that multiple.

        Raises:
            ConfigError: a width outside 1..5, unsorted or duplicate values, a context not a multiple of the
                ratios, buckets that do not cover ``max_ctx``, or ``max_ctx`` above the model's context length.
        """
        unit = _ratio_unit(cfg)
        if max_ctx < 1 or max_ctx > cfg.max_position:
            raise ConfigError(f"max_ctx must be in 1..{cfg.max_position} (the model's context length), found {max_ctx}")
        if contexts is None:
            top = -(-max_ctx // unit) * unit
            c, out = unit * -(-256 // unit), []  # smallest multiple of the ratios >= 256 tokens
            while c < top:
                out.append(c)
                c *= 2
            contexts = tuple(out) + (top,)
        spec = cls(tuple(int(w) for w in widths), tuple(int(c) for c in contexts), int(max_ctx))
        spec.validate(cfg)
        return spec

    def validate(self, cfg: Ds4Config) -> None:
        """Raises ConfigError naming what is wrong (see :meth:`build`)."""
        if not self.widths or any(not 1 <= w <= MAX_WIDTH for w in self.widths):
            raise ConfigError(f"widths must be in 1..{MAX_WIDTH}, found {list(self.widths)}")
        if list(self.widths) != sorted(set(self.widths)):
            raise ConfigError(f"widths must be increasing without repeats, found {list(self.widths)}")
        unit = _ratio_unit(cfg)
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)):
            raise ConfigError(f"context buckets must be increasing without repeats, found {list(self.contexts)}")
        if self.contexts[0] < unit:
            raise ConfigError(f"context buckets must be positive multiples of {unit} (every compress ratio of "
                              f"{cfg.name}), found {list(self.contexts)}")
        bad = [c for c in self.contexts if c % unit]
        if bad:
            raise ConfigError(f"context buckets must be multiples of {unit} (every compress ratio of "
                              f"{cfg.name}), found {bad}")
        if self.contexts[-1] < self.max_ctx:
            raise ConfigError(f"context buckets {list(self.contexts)} do not cover max_ctx={self.max_ctx}: "
                              f"the largest must be >= {self.max_ctx}")
        unused = [c for c in self.contexts if c > self.max_ctx and c != next(x for x in self.contexts
                                                                        if x >= self.max_ctx)]
        if unused:
            raise ConfigError(f"context buckets {unused} can never be used: max_ctx={self.max_ctx} is already "
                              f"covered by a smaller bucket")
        top = -(-cfg.max_position // unit) * unit
        if self.contexts[-1] > top:
            raise ConfigError(f"context buckets must be at most {top} (the model's context length "
                              f"{cfg.max_position}, rounded up to a multiple of {unit}), found {self.contexts[-1]}")

    def bucket(self, pos: int, width: int) -> int:
        """The context capacity for a step of ``width`` rows starting at ``pos``.

        Raises:
            StepError: the width is not compiled, or ``pos + width`` exceeds ``max_ctx``.
        """
        if width not in self.widths:
            raise StepError(f"no step graph for width {width}: compiled widths are {list(self.widths)}")
        end = pos + width
        if pos < 0 or end > self.max_ctx:
            raise StepError(f"positions {pos}..{end - 1} are outside the context 0..{self.max_ctx - 1}")
        return next(c for c in self.contexts if end <= c)

    def keys(self) -> list[tuple[int, int]]:
        """Every (width, context) graph key."""
        return [(w, c) for w in self.widths for c in self.contexts]

    def as_dict(self) -> dict:
        return {"widths": list(self.widths), "contexts": list(self.contexts), "max_ctx": self.max_ctx}

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()


def _ratio_unit(cfg: Ds4Config) -> int:
    """The least common multiple of the compress ratios used by the config's layers."""
    unit = 1
    for r in set(cfg.compress_ratios[: cfg.n_layers]) - {0}:
        unit = unit * r // math.gcd(unit, r)
    return unit


def span_capacity(context: int, ratio: int) -> int:
    """Compressed rows of one ratio a bucket of ``context`` tokens holds."""
    return context // ratio


#: the narrowest prefill chunk graph: below it a chunk's projections would be GEMVs of more rows than the GEMV
#: family takes (runtime/lower_prefill.py ``GEMM_MIN_ROWS``), and a tail this short is as cheap as verify steps
MIN_PREFILL_CHUNK = 16

#: the prefill chunk graphs a compiled engine builds when none are asked for (docs/prefill.md): 256
#: rows for short prompts and the tail, 2048 for long ones (the grouped experts reach their tensor-core rate
#: from ~2048 rows, docs/perf.md)
DEFAULT_PREFILL_CHUNKS = (256, 2048)


def check_prefill_chunks(chunks: object) -> tuple[int, ...]:
    """Prefill chunk sizes (docs/prefill.md: the row counts C of the prefill chunk graphs), validated and sorted.

    Args:
        chunks: ints in ``MIN_PREFILL_CHUNK .. MAX_PREFILL_ROWS`` (a tuple or list; duplicates are an error),
            or a comma-separated string such as ``"256,2048"`` (the CLI's ``--prefill``). Empty or ``"none"``:
            none.

    Returns:
        The sizes, ascending.

    Raises:
        StepError: a size that is not an int in range, a duplicate, or a string that is not comma-separated
            ints (one line naming what was found).
    """
    from ds4c.config import MAX_PREFILL_ROWS

    want = f"prefill chunk sizes: expected distinct ints in {MIN_PREFILL_CHUNK}..{MAX_PREFILL_ROWS}"
    if isinstance(chunks, str):
        text = chunks.strip()
        parts = [p.strip() for p in text.split(",")] if text and text.lower() != "none" else []
        if any(not (p.isascii() and p.isdigit()) for p in parts):  # '²'.isdigit() is True, int('²') fails
            raise StepError(f"{want} separated by commas (e.g. 256,2048), found {chunks!r}")
        chunks = [int(p) for p in parts]
    if not isinstance(chunks, (tuple, list)):
        raise StepError(f"{want} as a tuple or list (or a string such as '256,2048'), found "
                        f"{type(chunks).__name__} {chunks!r}")
    bad = [c for c in chunks if isinstance(c, bool) or not isinstance(c, int)
           or not MIN_PREFILL_CHUNK <= c <= MAX_PREFILL_ROWS]
    if bad:
        raise StepError(f"{want}, found {bad[0]!r}")
    if len(set(chunks)) != len(chunks):
        raise StepError(f"{want}, found a duplicate in {list(chunks)}")
    return tuple(sorted(chunks))


def prefill_chunk_for(chunks: tuple[int, ...], remaining: int, pos: int, max_ctx: int) -> int | None:
    """The chunk graph to run next when ``remaining`` prompt tokens start at ``pos`` (the prefill policy):

    * fewer than ``MIN_PREFILL_CHUNK`` tokens left: None (the tail goes as verify steps);
    * the smallest chunk above ``remaining`` when they fill at least half of it (padded: its rows past
      ``remaining`` are masked by ``n_valid``);
    * else the largest chunk ``C <= remaining`` (full, no padding);
    * else the smallest chunk above ``remaining`` (padded).

    Half full is enough because a chunk's time grows far slower than its rows: the grouped experts read every
    routed expert's weights at any C >= 256 (H200, flash-l4: a 2048-row chunk ~92 ms, a 256-row one ~17 ms,
    derived from ``ds4c bench`` and ``ds4c generate``), so 1952 tokens as one padded 2048 chunk cost ~2/3 of
    7 full 256 chunks and a padded one (docs/perf.md, session 11).
    Only chunks whose rows all fit the context (``pos + C <= max_ctx``) are candidates, padded rows included.
    ``chunks`` ascending (:func:`check_prefill_chunks`)."""
    if remaining < MIN_PREFILL_CHUNK:
        return None
    fit = [c for c in chunks if pos + c <= max_ctx]
    up = next((c for c in fit if c > remaining), None)
    if up is not None and 2 * remaining >= up:
        return up
    full = [c for c in fit if c <= remaining]
    return full[-1] if full else up
