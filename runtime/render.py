"""Render kernel templates (``templates/``, installed as ``ds4c.templates``) into self-contained sources.

Every kernel template starts with ``{% include "prelude/<vendor>.h.j2" %}`` and
``{% include "prelude/common.h.j2" %}``: the vendor prelude is the only place vendor differences live (lane
id, shuffles, wave size, atomics, math builtins, launch attributes), so the CUDA build run on a GPU
validates the kernel body the HIP build also uses. Rendered sources contain no ``#include``: the source
text plus the texts of the templates used is the whole input of a compile (and of its cache key).
"""

from __future__ import annotations

import hashlib
import threading
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


def resolve_mma_engine(engine: str, target: Target, family: str) -> str:
    """A family's ``engine`` for ``target``: ``auto`` is ``mma`` (CUDA ``mma.sync``) on CUDA and ``simt`` on HIP.

    Raises:
        RenderError: ``mma`` asked for a HIP target.
    """
    if engine == "auto":
        return "mma" if target.vendor == "cuda" else "simt"
    if engine == "mma" and target.vendor != "cuda":
        raise RenderError(f"{family}: engine 'mma' (mma.sync) is CUDA only, found target {target.slug}; expected "
                          f"engine 'simt' or 'auto'" + (" (or 'xm', AMD matrix cores)" if family == "gemm" else ""))
    return engine


#: How a template calls the programmatic-dependent-launch entry (``prelude/cuda.h.j2``); the macro's own
#: definition has no semicolon after the parentheses, so only a kernel body matches.
PDL_CALL = "DS4C_PDL_ENTRY();"


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

    @property
    def programmatic_launch(self) -> bool:
        """True when the kernel may be launched with programmatic stream serialization (programmatic dependent
        launch): it calls ``DS4C_PDL_ENTRY()`` (``prelude/cuda.h.j2``: wait for the stream's previous kernel,
        then let the next one launch) and targets CUDA sm_90 or newer, where that macro is not a no-op."""
        return (self.target.vendor == "cuda" and int(self.target.arch.removeprefix("sm_").rstrip("a")) >= 90
                and PDL_CALL in self.source)


class _TextLoader(jinja2.FileSystemLoader):
    """Keeps the text of every template it loads, by name (updated when a changed file is reloaded)."""

    def __init__(self, root: Path):
        super().__init__(str(root))
        self.texts: dict[str, str] = {}

    def get_source(self, environment: jinja2.Environment, template: str):  # type: ignore[override]
        src, filename, uptodate = super().get_source(environment, template)
        self.texts[template] = src
        return src, filename, uptodate


class _RecordingEnvironment(jinja2.Environment):
    """A Jinja environment that keeps compiled templates across renders (parsing a template costs far more
    than rendering it) and records, per render, every template used: the main one and its includes, cache
    hits included (``get_template`` / ``select_template`` are what include statements call)."""

    def __init__(self, root: Path):
        self.text_loader = _TextLoader(root)
        self._rec = threading.local()
        super().__init__(loader=self.text_loader, undefined=jinja2.StrictUndefined, trim_blocks=True,
                         lstrip_blocks=True, keep_trailing_newline=True, auto_reload=True, cache_size=-1)

    def _record(self, t: jinja2.Template) -> jinja2.Template:
        seen = getattr(self._rec, "seen", None)
        if seen is not None and t.name is not None:
            seen[t.name] = self.text_loader.texts[t.name]
        return t

    def get_template(self, name, parent=None, globals=None):  # type: ignore[override]
        return self._record(super().get_template(name, parent, globals))

    def select_template(self, names, parent=None, globals=None):  # type: ignore[override]
        return self._record(super().select_template(names, parent, globals))

    def render_recording(self, template: str, params: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """``(rendered text, {template name: text} of every template used)``."""
        self._rec.seen = {}
        try:
            text = self.get_template(template).render(**params)
            return text, dict(sorted(self._rec.seen.items()))
        finally:
            self._rec.seen = None


_ENVS: dict[Path, _RecordingEnvironment] = {}
_ENVS_LOCK = threading.Lock()


def _environment(root: Path) -> _RecordingEnvironment:
    with _ENVS_LOCK:
        env = _ENVS.get(root)
        if env is None:
            env = _ENVS[root] = _RecordingEnvironment(root)
        return env


def render(template: str, name: str, family: str, target: Target, params: dict[str, Any],
           entry: str | None = None) -> KernelSource:
    """Render ``template`` (a path under ``templates/``) for ``target`` with ``params``.

    ``vendor`` and ``wave`` are added to the parameters. ``entry`` defaults to ``name`` with characters
    other than letters, digits and ``_`` replaced by ``_``. Compiled templates are kept per process (and
    reloaded when their file changes).

    Raises:
        RenderError: missing template, or an undefined parameter used by the template.
    """
    env = _environment(Path(TEMPLATE_DIR))
    entry = entry or "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    full = {**params, "vendor": target.vendor, "wave": target.wave, "entry": entry}
    try:
        text, used = env.render_recording(template, full)
    except jinja2.TemplateNotFound as e:
        raise RenderError(f"no kernel template {e.name!r} under {TEMPLATE_DIR}") from None
    except jinja2.UndefinedError as e:
        raise RenderError(f"template {template!r} for {name}: {e.message} (params given: {sorted(params)})") from None
    return KernelSource(name, family, target, entry, text, used, dict(params))
