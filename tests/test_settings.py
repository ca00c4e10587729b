"""ds4c/settings.py owns every DS4C_* environment variable: read when used, documented in one table (its docstring
and docs/settings.md), shown by ``ds4c info --env``; the default model store lives below the API (no API -> CLI
import); one CUDA toolkit discovery; one atomic file writer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4c import settings
from ds4c.cli import main
from ds4c.tempfiles import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
#: Readers not yet moved into ds4c/settings.py (none left: runtime/step/compiled.py reads ``settings.pdl()``).
PENDING: set[tuple[str, str]] = set()


def test_every_setting_is_in_both_tables():
    doc_rows = re.findall(r"^\| `(DS4C_[A-Z0-9_]+)` \| ([^|]+) \|", (ROOT / "docs/settings.md").read_text(), re.M)
    assert [n for n, _ in doc_rows] == [s.name for s in settings.SETTINGS]
    for (name, default), s in zip(doc_rows, settings.SETTINGS):
        assert default.strip().strip("`") == s.default, name
        assert re.search(rf"^``{s.name}``\s+{re.escape('``' + s.default + '``' if s.default[0] != '(' else s.default)}",
                         settings.__doc__, re.M), s.name


def test_nothing_else_reads_a_ds4c_variable():
    """Product code (ds4c/, runtime/, passes/) reads DS4C_* only through ds4c.settings."""
    found = set()
    for top in ("ds4c", "runtime", "passes"):
        for p in (ROOT / top).rglob("*.py"):
            rel = p.relative_to(ROOT).as_posix()
            if rel == "ds4c/settings.py":
                continue
            for m in re.finditer(r"(?:environ(?:\.get)?\s*[\(\[]|getenv\s*\()\s*[\"'](DS4C_[A-Z0-9_]+)", p.read_text()):
                found.add((rel, m.group(1)))
    assert found <= PENDING, sorted(found - PENDING)


def test_settings_are_read_when_used(monkeypatch, tmp_path):
    monkeypatch.delenv("DS4C_PREFILL_ATTN_HPB", raising=False)
    assert settings.prefill_attn_heads_per_block() == 4
    monkeypatch.setenv("DS4C_PREFILL_ATTN_HPB", "2")
    assert settings.prefill_attn_heads_per_block() == 2
    monkeypatch.setenv("DS4C_HOME", str(tmp_path))
    assert settings.home() == tmp_path
    monkeypatch.setenv("DS4C_HOME", "")  # empty: unset
    assert settings.home() == Path.home() / ".cache" / "ds4c"
    monkeypatch.setenv("DS4C_CACHE", "~/k")
    assert settings.kernel_cache_root() == Path.home() / "k"
    for value, on in (("1", True), ("0", False), ("", False), (" 1", True)):
        monkeypatch.setenv("DS4C_PDL", value)
        assert settings.pdl() is on
    for value, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("DS4C_XP_PREQUANT", value)
        assert settings.experts_prequant() is on
    for value, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("DS4C_LANE_BATCH", value)
        assert settings.lane_batch() is on
    for value, n in (("", 16), ("8", 8), ("16", 16)):
        monkeypatch.setenv("DS4C_GEMV_ROWS", value)
        assert settings.gemv_rows() == n


@pytest.mark.parametrize("name, value", [("DS4C_PREFILL_ATTN_HPB", "x"), ("DS4C_PREFILL_ATTN_HPB", "0"),
                                         ("DS4C_PREFILL_ATTN_THREADS", "-1")])
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    read = next(s.read for s in settings.SETTINGS if s.name == name)
    with pytest.raises(settings.SettingsError) as ei:
        read()
    assert str(ei.value).startswith(f"${name}: expected an int >= ") and repr(value) in str(ei.value)
    assert "\n" not in str(ei.value)


def test_info_env_shows_every_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4C_HOME", str(tmp_path))
    monkeypatch.setenv("DS4C_PREFILL_ATTN_THREADS", "nope")
    r = CliRunner().invoke(main, ["info", "--env"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split()[0] == "variable" and len(lines) == 1 + len(settings.SETTINGS)
    home = next(ln for ln in lines if ln.startswith("DS4C_HOME "))
    assert str(tmp_path) in home and "~/.cache/ds4c" in home
    assert "invalid (expected an int >= 0)" in next(ln for ln in lines if ln.startswith("DS4C_PREFILL_ATTN_THREADS"))
    rec = json.loads(CliRunner().invoke(main, ["info", "--env", "--json"]).stdout)
    assert [x["name"] for x in rec["env"]] == [s.name for s in settings.SETTINGS]
    assert rec["env"][0] == {"name": "DS4C_HOME", "value": str(tmp_path), "used": str(tmp_path),
                             "default": "~/.cache/ds4c", "doc": settings.SETTINGS[0].doc}
    bad = CliRunner().invoke(main, ["info", "x.gguf", "--env"])
    assert bad.exit_code == 2 and "--env prints the environment settings alone" in bad.stderr


def test_a_secret_setting_is_never_shown(monkeypatch):
    """DS4C_API_KEY (ds4c serve's key): info --env says whether it is set, never its value."""
    monkeypatch.setenv("DS4C_API_KEY", "sk-very-secret")
    assert settings.api_key() == "sk-very-secret"
    r = CliRunner().invoke(main, ["info", "--env"])
    js = CliRunner().invoke(main, ["info", "--env", "--json"])
    assert r.exit_code == js.exit_code == 0 and "sk-very-secret" not in r.output + js.output
    row = next(x for x in json.loads(js.stdout)["env"] if x["name"] == "DS4C_API_KEY")
    assert (row["value"], row["used"]) == ("(hidden)", "(hidden)")
    monkeypatch.delenv("DS4C_API_KEY")
    row = next(x for x in settings.describe() if x["name"] == "DS4C_API_KEY")
    assert (row["value"], row["used"], settings.api_key()) == (None, "(unset)", None)


def test_the_api_does_not_import_the_cli():
    """The default model store lives in ds4c.default_model, below the API: opening the API loads no CLI."""
    code = "import sys, ds4c.api; print(sorted(m for m in sys.modules if m.startswith('ds4c.cli')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_inspect_ir_dot_goes_through_the_atomic_writer(tmp_path):
    import ds4c.cli.inspect_ir as inspect_ir

    assert inspect_ir.write_text_atomic is write_text_atomic
    dot = tmp_path / "g.dot"
    dot.write_text("previous")
    r = CliRunner().invoke(main, ["inspect-ir", "--preset", "tiny", "--max-ctx", "64", "--dot", str(dot)])
    assert r.exit_code == 0 and dot.read_text().startswith("digraph"), r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.dot"]


@pytest.mark.parametrize("name, value", [("DS4C_PDL", "yes"), ("DS4C_LANE_BATCH", "off"), ("DS4C_LANE_STREAMS", "true"),
                                         ("DS4C_XP_PREQUANT", "2")])
def test_an_on_off_setting_takes_only_1_or_0(monkeypatch, name, value):
    """An on/off setting is ``1`` or ``0``: anything else is refused in one line, not read as on or off (a
    ``DS4C_LANE_BATCH=false`` A/B would otherwise measure the mode it meant to turn off)."""
    monkeypatch.setenv(name, value)
    read = next(s.read for s in settings.SETTINGS if s.name == name)
    with pytest.raises(settings.SettingsError, match=rf"^\${name}: expected 1 or 0, found {value!r}"):
        read()


@pytest.mark.parametrize("value", ["0", "17", "abc"])
def test_gemv_rows_is_an_int_in_1_to_16(monkeypatch, value):
    monkeypatch.setenv("DS4C_GEMV_ROWS", value)
    with pytest.raises(settings.SettingsError, match=rf"^\$DS4C_GEMV_ROWS: expected an int in 1\.\.16, found '{value}'"):
        settings.gemv_rows()


@pytest.mark.parametrize("value", ["4", "1", "three"])
def test_prefill_stages_is_2_3_or_auto(monkeypatch, value):
    """``DS4C_PREFILL_STAGES``: 2 or 3 force every prefill GEMM / grouped-experts launch, unset or ``auto`` (0) let the
    lowering pick per launch; anything else is refused in one line."""
    for ok, want in (("2", 2), (" 3 ", 3), ("auto", 0)):
        monkeypatch.setenv("DS4C_PREFILL_STAGES", ok)
        assert settings.prefill_stages() == want
    monkeypatch.delenv("DS4C_PREFILL_STAGES")
    assert settings.prefill_stages() == 0
    monkeypatch.setenv("DS4C_PREFILL_STAGES", value)
    want = rf"^\$DS4C_PREFILL_STAGES: expected 2, 3 or auto, found {value!r}"
    with pytest.raises(settings.SettingsError, match=want):
        settings.prefill_stages()
