"""The engine contract (ds4c/engine_protocol.py) and the compiled step's facade (runtime/step/), on the CPU.

The compiled step keeps every public method and attribute the single-module ``CompiledStep`` had (the names are
frozen here), ``CompiledStep`` and ``ShardedStep`` both satisfy ``CompiledEngine``, the reference engines and the
drafters satisfy the protocols they declare, a drafter's needs are resolved by ``open_engine`` (a faked CUDA device
records what the compiled step would be built with), the loop, speculative decoding and the drafters hold no
capability probes but the ones listed, and they import the runtime one way (no cycle, function-local imports
counted). The compiled step itself runs on a GPU: ``pytest -m gpu`` (tests/test_compiled_step.py and the others).
"""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import pytest
import torch

from ds4c.drafters.dspark import DSparkDrafter
from ds4c.drafters.dspark_synth import make_dspark
from ds4c.drafters.mtp import MTPDrafter
from ds4c.drafters.mtp_synth import make_mtp
from ds4c.drafters.oracle import OracleDrafter
from ds4c.engine import open_engine, resolve_needs
from ds4c.engine_protocol import (NO_NEEDS, BuiltRecording, ChunkedPrefill, CompiledEngine, ConfidenceHead,
                                  DeclaresNeeds, DeviceGreedyVerify, DeviceLoop, Drafter, Engine, EngineNeeds,
                                  FinalHCReader, GraphHost, HostOnlyDrafter, PipelinedVerify, ReportsConfidence,
                                  SamplingDrafter, Snapshots, TapReader, TapsOnRequest, drafter_needs)
from ds4c.errors import Ds4cError
from ds4c.sources import open_model
from ds4c.reference import Reference, ShardedReference
from ds4c.runtime.sharded import ShardedStep
from ds4c.runtime.step import CompiledStep
from ds4c.shard_plan import parse_plan

ROOT = Path(__file__).resolve().parents[1]

OLD_PUBLIC = {
    # methods and properties of the single-module CompiledStep (runtime/executor.py before the split)
    "accept_on_device", "arm_undo", "capture_ms", "decode", "decode_tokens", "fill_scalars", "final_hc",
    "final_hc_ring", "final_hc_rows", "greedy_pipeline", "hand_off_to", "load_weights", "main_hidden", "max_ctx",
    "module", "prefill", "prepare", "prepare_all", "record_final_hc", "records_final_hc", "reset", "restore",
    "rollback", "shared_weight", "snapshot", "step", "step_offsets", "tap_ring", "tap_rows", "time_launches",
    "time_replays", "token_slot", "values", "verify", "verify_greedy",
    # its public instance attributes
    "artifact", "binary_batches", "buckets", "cache", "capacity", "captures", "cfg", "decode_modes", "dev", "hc_in",
    "hc_out", "is_first", "is_last", "last_prefill", "layers", "load_stats", "local_taps", "mf", "plan", "pos",
    "prefill_chunks", "prepare_stats", "programmatic", "record_hc", "shard", "state", "taps", "target",
    "token_sinks", "use_graphs",
}


def _assigned(cls: type) -> set[str]:
    """The attributes ``cls``'s methods assign on ``self`` (read from its source: instances need a GPU)."""
    import inspect

    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def _members(proto: type) -> set[str]:
    """The members a protocol declares, its bases' included."""
    out: set[str] = set()
    for base in proto.__mro__:
        if base in (object, typing.Protocol, typing.Generic) or not getattr(base, "_is_protocol", False):
            continue
        out |= set(getattr(base, "__annotations__", {}))
        out |= {n for n, v in vars(base).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return out


def _offers(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")} | _assigned(cls)


def test_the_facade_keeps_the_public_api():
    """Every public method, property and attribute of the compiled step before the split is still there."""
    missing = OLD_PUBLIC - _offers(CompiledStep)
    assert not missing, f"CompiledStep lost {sorted(missing)}"
    # the parts, one job each, are public too
    assert {"weights", "graphs", "scalars", "sequence", "driver", "verifier", "loop"} <= _assigned(CompiledStep)


@pytest.mark.parametrize("cls", [CompiledStep, ShardedStep])
def test_compiled_and_sharded_steps_satisfy_one_protocol(cls):
    missing = _members(CompiledEngine) - _offers(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)} of CompiledEngine"


def test_the_unsplit_compiled_step_has_every_capability():
    for proto in (Engine, Snapshots, ChunkedPrefill, DeviceLoop, DeviceGreedyVerify, PipelinedVerify, TapReader,
                  FinalHCReader, BuiltRecording, GraphHost):
        missing = _members(proto) - _offers(CompiledStep)
        assert not missing, f"CompiledStep lacks {sorted(missing)} of {proto.__name__}"
    # the split has no device acceptance, pipeline, chunked prefill or shared graphs: the loop takes other paths
    for proto in (DeviceGreedyVerify, PipelinedVerify, ChunkedPrefill, GraphHost):
        assert _members(proto) - _offers(ShardedStep), proto.__name__


def test_the_reference_engines_are_engines(tiny_weights, tiny_path):
    ref = Reference(tiny_weights, max_ctx=32)
    for proto in (Engine, Snapshots, TapReader, TapsOnRequest, FinalHCReader):
        assert isinstance(ref, proto), proto.__name__
    for proto in (ChunkedPrefill, DeviceLoop, DeviceGreedyVerify, PipelinedVerify, BuiltRecording, GraphHost,
                  CompiledEngine):
        assert not isinstance(ref, proto), proto.__name__
    ref.verify([5, 17, 301], 0)
    assert ref.pos == ref.state.pos == 3
    mf = open_model(tiny_path)
    split = ShardedReference.load(mf, parse_plan("cpu,cpu", "3,3", mf.config.n_layers), max_ctx=32)
    assert isinstance(split, Engine) and isinstance(split, TapReader) and not isinstance(split, FinalHCReader)
    assert not isinstance(split, TapsOnRequest)  # the DSpark drafter's reference path refuses it


def test_drafters_declare_what_they_need(tiny_path, tmp_path):
    mf = open_model(tiny_path)
    dspark = DSparkDrafter(make_dspark(mf, tmp_path / "d.gguf", seed=1))
    mtp = MTPDrafter(make_mtp(mf.config, tmp_path / "m.gguf", seed=0), target=mf.config, target_file=mf)
    oracle = OracleDrafter(0.5, mf.config.vocab_size, sep=1.0)
    assert drafter_needs(dspark) == EngineNeeds(taps=dspark.file.taps) and dspark.file.taps
    assert drafter_needs(mtp) == EngineNeeds(final_hc=True)
    assert drafter_needs(oracle) == NO_NEEDS and drafter_needs(None) == NO_NEEDS

    class Custom:  # a drafter of the caller's: prepare and propose only
        def prepare(self, stepper, prompt, n):
            pass

        def propose(self, context, k):
            return [], None

    assert isinstance(Custom(), Drafter) and drafter_needs(Custom()) == NO_NEEDS
    for d in (dspark, mtp, oracle):
        assert isinstance(d, Drafter) and isinstance(d, DeclaresNeeds)
    assert isinstance(oracle, HostOnlyDrafter) and oracle.host_only and not isinstance(dspark, HostOnlyDrafter)
    assert isinstance(oracle, ConfidenceHead) and isinstance(oracle, ReportsConfidence)
    assert isinstance(dspark, SamplingDrafter) and isinstance(mtp, SamplingDrafter)
    assert not isinstance(oracle, SamplingDrafter) and not isinstance(object(), Drafter)


def test_resolve_needs():
    taps, mtp = EngineNeeds(taps=(3, 4, 5)), EngineNeeds(final_hc=True)
    assert resolve_needs(taps, "compiled", False) == ((3, 4, 5), False)
    assert resolve_needs(mtp, "compiled", True) == ((), True)  # the last shard of a split records it
    assert resolve_needs(taps, "reference", False) == ((), False)  # the reference records on request
    assert resolve_needs(mtp, "reference", False) == ((), False)
    assert resolve_needs(taps, "compiled", False, taps=(3, 4, 5), record_hc=True) == ((3, 4, 5), True)
    assert resolve_needs(NO_NEEDS, "compiled", False, taps=(1,)) == ((1,), False)
    for needs, engine, split, artifact, kw, msg in (
            (taps, "compiled", True, None, {}, "the DSpark drafter runs on an unsplit target"),
            (taps, "reference", True, None, {}, "the DSpark drafter runs on an unsplit target"),
            (taps, "compiled", False, "art", {}, "not served from an artifact yet"),
            (mtp, "reference", True, None, {}, "the reference engine records unsplit only"),
            (taps, "compiled", False, None, {"taps": (1, 2)}, r"taps \[1, 2\]: the drafter reads the taps of layers "
                                                              r"\[3, 4, 5\]")):
        with pytest.raises(Ds4cError, match=msg) as ei:
            resolve_needs(needs, engine, split, artifact, **kw)
        assert "\n" not in str(ei.value)


def test_open_engine_builds_the_compiled_step_for_the_drafter(monkeypatch, tiny_path, tmp_path):
    """``open_engine(draft=...)`` on a (faked) CUDA device builds the compiled step with the drafter's taps or its
    final HC recording, without the caller naming them; a need the engine cannot serve is refused before anything
    is built."""
    import ds4c.runtime.sharded as sh
    import ds4c.runtime.step as st

    built: list[dict] = []

    class Recorded:
        def __init__(self, mf, buckets, arch, artifact=None, plan=None, taps=(), record_hc=False, prefill_chunks=()):
            built.append({"taps": taps, "record_hc": record_hc, "chunks": prefill_chunks})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(st, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(st, "CompiledStep", Recorded)
    monkeypatch.setattr(sh, "free_memory", lambda devices: [64 << 30] * len(devices))
    mf = open_model(tiny_path)
    dspark = DSparkDrafter(make_dspark(mf, tmp_path / "d.gguf", seed=1))
    mtp = MTPDrafter(make_mtp(mf.config, tmp_path / "m.gguf", seed=0), target=mf.config, target_file=mf)
    kw = dict(device="cuda", max_ctx=64, prepare=False, progress=False, prefill_chunks=())
    open_engine(mf, draft=dspark, **kw)
    open_engine(mf, draft=mtp, **kw)
    open_engine(mf, draft=OracleDrafter(0.5, 512), **kw)
    open_engine(mf, taps=dspark.file.taps, record_hc=True, **kw)  # the explicit form still works
    assert built == [{"taps": dspark.file.taps, "record_hc": False, "chunks": ()},
                     {"taps": (), "record_hc": True, "chunks": ()},
                     {"taps": (), "record_hc": False, "chunks": ()},
                     {"taps": dspark.file.taps, "record_hc": True, "chunks": ()}]
    with pytest.raises(Ds4cError, match="the DSpark drafter runs on an unsplit target"):
        open_engine(mf, draft=dspark, layer_split="3,3", **kw)
    assert len(built) == 4


def test_the_model_opens_its_engine_for_its_drafter(tiny_path, tmp_path):
    """``Model(draft=...)`` on the reference: the drafter is ``generate``'s default (made per request from the
    spelling, with the request's seed), the same as passing it to ``generate``; a need the engine cannot serve is
    refused when the Model opens."""
    from ds4c.api import Model

    mf = open_model(tiny_path)
    path = make_mtp(mf.config, tmp_path / "m.gguf", seed=0)
    ids = [5, 17, 301, 42]
    m = Model(tiny_path, max_ctx=64, draft=f"mtp:{path}")
    own = m.generate(ids, max_new_tokens=6, ignore_eos=True, spec_width=3, seed=4)
    given = Model(tiny_path, max_ctx=64).generate(ids, max_new_tokens=6, ignore_eos=True, spec_width=3, seed=4,
                                                  draft=f"mtp:{path}")
    assert own.speculative is not None and own.speculative["drafter"] == "mtp:m.gguf"
    assert own.ids == given.ids and own.speculative["steps"] == given.speculative["steps"]
    with pytest.raises(Ds4cError, match="the reference engine records unsplit only"):
        Model(tiny_path, max_ctx=64, layer_split="3,3", draft=f"mtp:{path}")


# ------------------------------------------------------------------------------------------ probes and layers
ALLOWED_PROBES = {
    # (file, the probe's text): why it stays
    ("ds4c/engine_protocol.py", 'getattr(drafter, "name", None)'): "a display label a custom drafter may omit",
    ("ds4c/drafters/dspark.py", "getattr(self.file, 'identity', None)"): "the synthetic source's label (a file has none)",
}


def test_the_loop_and_the_drafters_probe_no_capabilities():
    """The generation loop, speculative decoding, the drafters, the engine's opening, the API, the benchmarks and the
    compiled step take the engine contract: no ``getattr`` / ``hasattr`` capability probes, but the listed ones
    (neither is a capability)."""
    files = ["ds4c/generate.py", "ds4c/speculative.py", "ds4c/sampling.py", "ds4c/engine_protocol.py",
             "ds4c/drafters/oracle.py", "ds4c/drafters/factory.py", "ds4c/drafters/dspark.py", "ds4c/drafters/mtp.py",
             "runtime/spec_pipeline.py", "runtime/step/compiled.py", "runtime/step/verify.py",
             "runtime/step/driver.py", "runtime/step/decode_loop.py", "runtime/step/sequence.py", "ds4c/engine.py",
             "ds4c/api.py", "ds4c/bench.py", "ds4c/prefill_bench.py", "runtime/sharded.py"]
    found = set()
    for f in files:
        for m in re.finditer(r"\b(getattr|hasattr)\([^()]*(\([^()]*\))?[^()]*\)", (ROOT / f).read_text()):
            found.add((f, m.group(0)))
    assert found == set(ALLOWED_PROBES), sorted(found - set(ALLOWED_PROBES))


def _imports(path: Path, module: str) -> set[str]:
    """The ds4c modules ``path`` imports, function-local imports included."""
    tree = ast.parse(path.read_text())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                base = ".".join(module.split(".")[:-n.level] + ([n.module] if n.module else []))
            out |= {base} | {f"{base}.{a.name}" for a in n.names}
    return {m for m in out if m.startswith("ds4c")}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("runtime", "passes"):
        parts = ["ds4c"] + parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def test_the_runtime_and_the_loop_import_one_way():
    """The runtime imports neither the generation loop, speculative decoding, nor the drafters (their file formats
    aside); the sampling rules and the engine contract import none of those either; and the loop, speculative
    decoding, the drafters and the runtime form no import cycle (function-local imports counted)."""
    upper = ("ds4c.generate", "ds4c.speculative", "ds4c.api", "ds4c.cli", "ds4c.engine")
    drafters_ok = ("ds4c.drafters.dspark_file",)
    graph: dict[str, set[str]] = {}
    paths = [*(ROOT / "runtime").rglob("*.py"), *(ROOT / "ds4c" / "drafters").glob("*.py"),
             *(ROOT / "ds4c").glob("*.py")]
    for p in paths:
        graph[_module(p)] = _imports(p, _module(p))
    for mod, deps in graph.items():
        if mod.startswith("ds4c.runtime") or mod in ("ds4c.sampling", "ds4c.engine_protocol"):
            bad = {d for d in deps if d.startswith(upper) or (d.startswith("ds4c.drafters.") and d not in drafters_ok
                                                                and not d.startswith(drafters_ok))}
            assert not bad, f"{mod} imports {sorted(bad)}"
    scope = [m for m in graph if m.startswith(("ds4c.runtime", "ds4c.drafters")) or m in (
        "ds4c.generate", "ds4c.speculative", "ds4c.sampling", "ds4c.engine_protocol", "ds4c.width_policy")]
    edges = {m: {d for d in graph[m] if d in scope and d != m} for m in scope}

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for d in edges.get(node, ()):
                if d == start:
                    return path + [d]
                if d not in seen:
                    seen.add(d)
                    stack.append((d, path + [d]))
        return None

    for m in edges:
        assert cycle_from(m) is None, " -> ".join(cycle_from(m))


def test_the_layers_import_downward():
    """The layer order of docs/README.md, function-local imports counted: the IR (ds4c/ir/) and the passes never
    import the runtime; nothing outside the CLI imports the CLI (it is the top: the server and the API sit below it).
    """
    files = [*(ROOT / "ds4c").rglob("*.py"), *(ROOT / "runtime").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]
    for p in files:
        mod = _module(p)
        deps = _imports(p, mod)
        if mod.startswith(("ds4c.ir", "ds4c.passes")):
            assert not {d for d in deps if d.startswith("ds4c.runtime")}, f"{mod} imports the runtime"
        if not mod.startswith("ds4c.cli"):
            assert not {d for d in deps if d == "ds4c.cli" or d.startswith("ds4c.cli.")}, f"{mod} imports the CLI"
