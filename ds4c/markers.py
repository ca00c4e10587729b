"""Markers in text that streams in pieces (stop strings, the model's DSML and reasoning tags): how much of the
text's end to hold back because the next piece may complete a marker (:func:`held_back`). Shared by
:class:`ds4c.api.Model`'s stop strings and the server's reply parser (:mod:`ds4c.server.toolcalls`)."""

from __future__ import annotations

from collections.abc import Collection


def held_back(text: str, markers: Collection[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers`` (0: none): those
    characters may be the start of a marker, so a streaming reader holds them until the next piece decides."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best
