"""Progress of long work on stderr: a tqdm bar on a terminal, plain periodic lines elsewhere.

A tqdm bar redraws itself with carriage returns; written to a file or a pipe (a CI log, ``2> log``) it becomes
one ever-growing line. :func:`progress_bar` gives a bar when its stream is a terminal and otherwise a
:class:`PlainProgress`, which prints a whole line (count, percent, rate, time left) every
:data:`PLAIN_INTERVAL_S` seconds and one when the work ends. Both wait ``delay`` seconds before saying anything,
so short work stays quiet.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from tqdm import tqdm

PLAIN_INTERVAL_S = 10.0
"""Seconds between two lines of :class:`PlainProgress` (also before its first one, at the least)."""


class PlainProgress:
    """A progress report of whole lines, for streams that are not terminals: ``DESC: N/TOTAL UNITs (P%), R
    UNITs/s, ETA T s`` every ``interval`` seconds (the first once ``max(delay, interval)`` seconds have passed) and
    ``DESC: TOTAL/TOTAL UNITs (100%) in T s, R UNITs/s`` at :meth:`close` when it printed anything before. The same
    ``update`` / ``close`` / context-manager surface as a tqdm bar.

    Args:
        total: the amount of work (units); ``unit``: its name (``"B"`` with ``unit_scale`` prints kB, MB...).
        file: where the lines go (default stderr, looked up when printing).
        clock: seconds (``time.monotonic``; a test passes its own).
    """

    def __init__(self, total: int, desc: str, unit: str = "it", unit_scale: bool = False, file: TextIO | None = None,
                 interval: float | None = None, delay: float = 0.0, disable: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.unit, self.unit_scale = int(total), desc, unit, unit_scale
        self.file, self.disable, self.clock = file, disable, clock
        self.interval = PLAIN_INTERVAL_S if interval is None else float(interval)
        self.n = 0
        self.t0 = clock()
        self._next = self.t0 + max(delay, self.interval)
        self.lines = 0
        """Lines printed so far."""

    def _amount(self, n: float) -> str:
        return tqdm.format_sizeof(n, self.unit, 1000) if self.unit_scale else f"{n:,.0f} {self.unit}s"

    def _rate(self, n: float, dt: float) -> str:
        if dt <= 0:
            return "rate n/a"
        r = n / dt
        return f"{tqdm.format_sizeof(r, self.unit, 1000)}/s" if self.unit_scale else f"{r:,.1f} {self.unit}s/s"

    def _say(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self.file or sys.stderr, flush=True)
        self.lines += 1

    def update(self, n: int = 1) -> None:
        """``n`` more units are done; prints a line when one is due."""
        self.n += n
        now = self.clock()
        if self.disable or now < self._next:
            return
        self._next = now + self.interval
        dt = now - self.t0
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total > 0 else ""
        eta = f", ETA {(self.total - self.n) * dt / self.n:.0f} s" if self.n and self.total >= self.n else ""
        done = self._amount(self.n) if self.unit_scale else f"{self.n:,d}"
        self._say(f"{done}/{self._amount(self.total)}{pct}, {self._rate(self.n, dt)}{eta}")

    def close(self) -> None:
        """The closing line (only when a line was printed before: short work says nothing)."""
        if not self.disable and self.lines:
            dt = self.clock() - self.t0
            pct = f" ({100 * self.n / self.total:.0f}%)" if self.total > 0 else ""
            done = self._amount(self.n) if self.unit_scale else f"{self.n:,d}"
            self._say(f"{done}/{self._amount(self.total)}{pct} in {dt:.1f} s, {self._rate(self.n, dt)}")
        self.disable = True

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: int, desc: str, unit: str = "it", unit_scale: bool = False, file: TextIO | None = None,
                 delay: float = 0.0, disable: bool = False) -> Any:
    """A tqdm bar over ``total`` units when ``file`` (default stderr) is a terminal, else a :class:`PlainProgress`
    (whole lines every :data:`PLAIN_INTERVAL_S` seconds). Nothing shows before ``delay`` seconds, nor with
    ``disable``. Use as a context manager; ``update(n)`` after each piece of work."""
    f = file or sys.stderr
    if _isatty(f):
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=f, delay=delay, disable=disable,
                    leave=True)
    return PlainProgress(total, desc, unit, unit_scale, file=f, delay=delay, disable=disable)


def _isatty(f: Any) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
