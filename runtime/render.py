"""Render kernel templates (``templates/``, installed as ``ds4c.templates``) into self-contained sources.

Every kernel template starts with ``{% include "prelude/<vendor>.h.j2" %}`` and
``{% include "prelude/common.h.j2" %}``: the vendor prelude is the only place vendor differences live (lane
id, shuffles, wave size, atomics, math builtins, launch attributes), so the CUDA build run on a GPU
validates the kernel body the HIP build also uses. Rendered sources contain no ``#include``: the source
text plus the texts of the templates used is the whole input of a compile (and of its cache key).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from ds4c.errors import Ds4cError
from ds4c.runtime.targets import Target

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"
try:  # installed layout: ds4c/templates next to ds4c/runtime
    import ds4c.templates as _t

    TEMPLATE_DIR = Path(_t.__file__).resolve().parent
except ImportError:  # pragma: no cover
    pass


class RenderError(Ds4cError):
    """A template is missing, or its parameters are incomplete or invalid."""


@dataclass(frozen=True)
class KernelSource:
    """A rendered kernel: ``entry`` is the ``extern "C"`` function name; ``templates`` maps every template
    used to its text (for cache keys and inspection); ``params`` the render parameters."""

    name: str
    family: str
    target: Target
    entry: str
    source: str
    templates: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def ext(self) -> str:
        return ".cu" if self.target.vendor == "cuda" else ".hip"

    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


class _RecordingLoader(jinja2.FileSystemLoader):
    """Remembers the text of every template it loads (the main one and its includes)."""

    def __init__(self, root: Path):
        super().__init__(str(root))
        self.seen: dict[str, str] = {}

    def get_source(self, environment: jinja2.Environment, template: str):  # type: ignore[override]
        src, filename, uptodate = super().get_source(environment, template)
        self.seen[template] = src
        return src, filename, uptodate


def render(template: str, name: str, family: str, target: Target, params: dict[str, Any],
           entry: str | None = None) -> KernelSource:
    """Render ``template`` (a path under ``templates/``) for ``target`` with ``params``.

    ``vendor`` and ``wave`` are added to the parameters. ``entry`` defaults to ``name`` with characters
    other than letters, digits and ``_`` replaced by ``_``.

    Raises:
        RenderError: missing template, or an undefined parameter used by the template.
    """
    loader = _RecordingLoader(TEMPLATE_DIR)
    env = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True)
    entry = entry or "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    full = {**params, "vendor": target.vendor, "wave": target.wave, "entry": entry}
    try:
        text = env.get_template(template).render(**full)
    except jinja2.TemplateNotFound as e:
        raise RenderError(f"no kernel template {e.name!r} under {TEMPLATE_DIR}") from None
    except jinja2.UndefinedError as e:
        raise RenderError(f"template {template!r} for {name}: {e.message} (params given: {sorted(params)})") from None
    return KernelSource(name, family, target, entry, text, dict(sorted(loader.seen.items())), dict(params))
