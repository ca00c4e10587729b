"""Progress of long work (issue 28.4): a bar on a terminal, plain periodic lines on a file or pipe (never a
carriage-return-joined line), for compile, make-model, weight loading and the prefill of ``ds4c generate``."""

from __future__ import annotations

import io
import re

import pytest
from click.testing import CliRunner

import ds4c.cli as cli
import ds4c.cli.generate as generate_cli
from ds4c import progress
from ds4c.api import Model
from ds4c.errors import Ds4cError
from ds4c.progress import PlainProgress, progress_bar
from ds4c.runtime.cache import KernelCache
from test_cache import FakeToolchain, axpy


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_progress_prints_whole_lines_at_intervals():
    now = [0.0]
    out = io.StringIO()
    p = PlainProgress(1000, "prefill", "token", file=out, interval=10.0, clock=lambda: now[0])
    for _ in range(10):
        now[0] += 4.0
        p.update(100)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # due at 12 s (300 done) and 24 s (600), then 36 s (900); the closing line at 40 s
    assert lines == ["prefill: 300/1,000 tokens (30%), 25.0 tokens/s, ETA 28 s",
                     "prefill: 600/1,000 tokens (60%), 25.0 tokens/s, ETA 16 s",
                     "prefill: 900/1,000 tokens (90%), 25.0 tokens/s, ETA 4 s",
                     "prefill: 1,000/1,000 tokens (100%) in 40.0 s, 25.0 tokens/s"], lines
    quiet = io.StringIO()
    with PlainProgress(10, "x", file=quiet, clock=lambda: 0.0) as q:  # short work: nothing at all
        q.update(10)
    assert quiet.getvalue() == ""
    b = io.StringIO()
    with PlainProgress(3 << 20, "weights", "B", unit_scale=True, file=b, interval=0.0) as q:
        q.update(1 << 20)
    assert re.match(r"weights: 1\.05MB/3\.15MB \(33%\), .*B/s, ETA", b.getvalue()), b.getvalue()


def test_progress_bar_is_tqdm_on_a_terminal_only():
    tty, pipe = _Tty(), io.StringIO()
    bar = progress_bar(5, "compile", "kernel", file=tty)
    bar.update(5)
    bar.close()
    assert "\r" in tty.getvalue() and "5/5" in tty.getvalue()
    assert isinstance(progress_bar(5, "compile", "kernel", file=pipe), PlainProgress)


def test_compile_progress_on_a_pipe_is_plain_lines(tmp_path, capsys, monkeypatch):
    """compile_many's bar on a non-terminal stderr (pytest's capture, like ``2> log``): whole lines, no \\r."""
    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.0)
    fake = FakeToolchain("fake", "1.0", "/opt/fake/bin/fakecc", counter=str(tmp_path / "compiles.txt"))
    srcs = [axpy(name=f"selftest.axpy{i}", threads=64 * (i + 1)) for i in range(3)]
    KernelCache(tmp_path / "cache").compile_many(srcs, jobs=1, toolchain=fake)
    err = capsys.readouterr().err
    assert "\r" not in err, repr(err)
    assert "cuda-sm_90: 3 distinct kernels, compiling 3, 0 cached" in err
    assert re.search(r"^compile: 1/3 kernels \(33%\), [\d.,]+ kernels/s, ETA \d+ s$", err, re.M), err
    assert re.search(r"^compile: 3/3 kernels \(100%\) in [\d.]+ s", err, re.M), err


def test_model_reports_prefill_progress(tiny_path):
    m = Model(tiny_path, max_ctx=64)
    seen: list[tuple[int, int]] = []
    ids = list(range(2, 25))
    c = m.generate(ids, max_new_tokens=2, on_prefill=lambda done, total: seen.append((done, total)))
    assert seen == [(5, 23), (10, 23), (15, 23), (20, 23), (23, 23)] and len(c.ids) == 2
    with pytest.raises(Ds4cError, match="on_prefill: expected a callable"):
        m.generate(ids, max_new_tokens=2, on_prefill=3)


@pytest.mark.parametrize("terminal", [False, True])
def test_cli_generate_shows_prefill_progress(tiny_path, tmp_path, monkeypatch, terminal):
    monkeypatch.setattr(generate_cli, "PREFILL_BAR_DELAY_S", 0.0)
    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.0)
    if terminal:
        monkeypatch.setattr(progress, "_isatty", lambda f: True)
    r = CliRunner().invoke(cli.main, ["generate", str(tiny_path), "--prompt-ids", ",".join(map(str, range(2, 25))),
                                      "--max-new-tokens", "2"], env={"DS4C_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    if terminal:  # tqdm: count, rate and time left, redrawn in place
        assert "\r" in r.stderr and re.search(r"prefill: 100%\|.*\| 23/23 \[[\d:]+<[\d:]+, +[\d.]+token/s\]",
                                              r.stderr), repr(r.stderr)
    else:
        assert "\r" not in r.stderr
        assert re.search(r"^prefill: 5/23 tokens \(22%\), [\d.,]+ tokens/s, ETA \d+ s$", r.stderr, re.M), r.stderr
        assert re.search(r"^prefill: 23/23 tokens \(100%\) in [\d.]+ s", r.stderr, re.M), r.stderr
    assert "tokens:" in r.stdout  # the output itself is unchanged (stdout)
