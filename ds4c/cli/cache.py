"""``ds4c cache list|show|clear``: the compiled-kernel cache (:class:`ds4c.runtime.cache.KernelCache`)."""

from __future__ import annotations

import json
import time

import click

from ds4c.cli.shell import Group


@click.group("cache", cls=Group)
def command() -> None:
    """Inspect or clear the compiled-kernel cache ($DS4C_CACHE or ~/.cache/ds4c/kernels)."""


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _human_age(seconds: float) -> str:
    s = max(0.0, seconds)
    for div, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if s >= div:
            return f"{s / div:.0f}{unit}"
    return f"{s:.0f}s"


@command.command("list")
def cache_list_cmd() -> None:
    """One line per cache entry: target, kernel name, hash, binary size, age; then the temporary folders of
    compiles (in progress, and the stale ones of killed compiles, which opening the cache removes)."""
    from ds4c.runtime.cache import KernelCache  # start-up speed

    cache = KernelCache()
    entries = cache.list()
    now = time.time()
    for e in entries:
        ver = "" if e.meta.get("ds4c_version") == cache.version else f"  (ds4c {e.meta.get('ds4c_version')})"
        click.echo(f"{e.target.slug:14s} {e.name:40s} {e.key[:12]}  {_human_bytes(e.size):>10s}  "
                   f"{_human_age(now - e.created):>4s}{ver}")
    click.echo(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} in {cache.root}")
    live, stale = cache.temporaries()
    click.echo(f"temporary folders: {live} of compiles in progress, {stale} stale left; {cache.swept} stale "
               f"removed on opening the cache")


@command.command("show")
@click.argument("key")
def cache_show_cmd(key: str) -> None:
    """Show one entry (KEY: a hash prefix from `ds4c cache list`): its key inputs, resource use, files."""
    from ds4c.runtime.cache import KernelCache  # start-up speed

    e = KernelCache().show(key)
    meta = {k: v for k, v in e.meta.items() if k not in ("templates", "resources")}
    click.echo(f"entry:    {e.path}")
    click.echo(f"key:      {e.key}")
    click.echo(f"kernel:   {e.name} (entry {e.entry}) for {e.target.slug}")
    click.echo(f"source:   {e.source_path}")
    click.echo(f"binary:   {e.binary_path} ({e.size:,d} bytes)")
    click.echo(f"log:      {e.log_path}")
    click.echo("templates: " + ", ".join(f"{n} ({len(t)} chars)" for n, t in e.meta.get("templates", {}).items()))
    click.echo("resources:")
    for fn, use in e.resources.items():
        click.echo(f"  {fn}: " + ", ".join(f"{k} {v}" for k, v in use.items()))
    if not e.resources:
        click.echo("  (none reported by the compiler)")
    click.echo("meta:")
    click.echo(json.dumps(meta, indent=2, sort_keys=True))


@command.command("clear")
def cache_clear_cmd() -> None:
    """Remove every cache entry (all ds4c versions)."""
    from ds4c.runtime.cache import KernelCache  # start-up speed

    cache = KernelCache()
    n = cache.clear()
    click.echo(f"removed {n} cache entr{'y' if n == 1 else 'ies'} from {cache.root}")
