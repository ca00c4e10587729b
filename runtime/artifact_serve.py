"""Whether an artifact serves a model, and the binaries it gives a model's lowering.

An artifact serves a model only when the config hash, the bucket spec, the taps, ``record_hc`` and the
weight-format table all match, it holds the chunk graphs of every prefill chunk size the caller asks for, and
every binary's recorded formats are those its launches read in the model (:func:`check_serves`, which
``ds4c inspect DIR --model FILE`` runs without a GPU, and the runtime before it loads anything).
:func:`check_lowering` and :func:`launch_binaries` pair the model's lowering with the artifact's binaries, launch by
launch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from ds4c.buckets import BucketSpec
from ds4c.config import Ds4Config
from ds4c.ir import build_step
from ds4c.passes.manager import run_pipeline
from ds4c.runtime import lower
from ds4c.runtime.artifact_manifest import (ArtifactError, chunks_text, effective_weight_types, find_target,
                                            first_format_difference, graph_key, manifest_buckets,
                                            manifest_prefill_chunks, prefill_keys, split_ranges, weight_formats)
from ds4c.runtime.targets import Target


def check_serves(man: dict[str, Any], artifact: str | os.PathLike, cfg: Ds4Config, weight_types: dict,
                 buckets: BucketSpec | None = None, layer_split: Iterable[int] | None = None,
                 taps: Iterable[int] = (), record_hc: bool = False, prefill_chunks: Iterable[int] = ()) -> None:
    """Check that the artifact ``man`` (:func:`load_manifest` of ``artifact``) serves a model: its config hash,
    its bucket spec (when ``buckets`` is given) and its weight-format table all equal the model's, and every
    binary was rendered for the formats its launches read in this model. ``weight_types`` is the model's
    ``{tensor name: GGMLType}`` (e.g. ``{n: mf.ggml_type(n) for n in mf.specs}``). ``layer_split``: the layers
    per shard the caller runs (None or one count: unsplit) must be the artifact's. ``taps``: the DSpark tap layers
    the caller's step records (empty: none) must be the artifact's (manifest ``taps``; none when absent): the tap
    kernel is part of every graph. ``record_hc``: whether the caller's step records the final HC state (the MTP
    drafter's input) must be the artifact's (manifest ``record_hc``). ``prefill_chunks``: the prefill chunk sizes
    the caller's step runs (ints; empty: none) must be among the artifact's (manifest ``prefill_chunks``): an
    artifact holding more chunk sizes serves a step that uses fewer. Needs no GPU.

    Raises:
        ArtifactError: the first mismatch, in one line: another config (both hashes), another bucket spec
            (both), another layer split, other taps (both, and the compile option that builds them), another
            ``record_hc`` (likewise), prefill chunks the artifact lacks (what it was compiled with, what was asked,
            the ``--prefill`` that builds them), or the
            first tensor whose format differs (the artifact's type vs the model's, and how many tensors differ).
    """
    where = f"artifact {artifact} does not serve this model"
    if man["config_hash"] != cfg.hash():
        raise ArtifactError(f"{where}: it was built for another config (hash {man['config_hash'][:12]}, "
                            f"{man['config'].get('name')}; this model {cfg.hash()[:12]}, {cfg.name}); rebuild it "
                            f"with `ds4c compile` for this model")
    if buckets is not None and man["buckets_hash"] != buckets.hash():
        raise ArtifactError(f"{where}: it was built for buckets {man['buckets']}, asked for {buckets.as_dict()}")
    if isinstance(layer_split, str) or not all(type(n) is int for n in (layer_split or ())):
        raise ArtifactError(f"check_serves: layer_split must be layer counts (ints) or None, found {layer_split!r}")
    want = list(layer_split or ())
    want = want if len(want) > 1 else None
    have = man.get("layer_split")
    if want != have:
        def split_name(x: list | None) -> str:
            return "the unsplit step" if x is None else f"layer split {','.join(map(str, x))}"

        how = "without --layer-split" if want is None else f"with --layer-split {','.join(map(str, want))}"
        raise ArtifactError(f"artifact {artifact} was compiled for {split_name(have)}, asked to serve "
                            f"{split_name(want)}; compile one {how} (`ds4c compile`)")
    want_taps, have_taps = [int(t) for t in taps], list(man.get("taps", ()))
    if want_taps != have_taps:
        def taps_name(x: list) -> str:
            return f"the DSpark taps {','.join(map(str, x))}" if x else "no DSpark taps"

        how = f"with --taps {','.join(map(str, want_taps))}" if want_taps else "without --taps / --draft"
        raise ArtifactError(f"artifact {artifact} was compiled with {taps_name(have_taps)}, asked to serve a step "
                            f"with {taps_name(want_taps)}; compile one {how} (`ds4c compile`)")
    if bool(record_hc) != bool(man.get("record_hc", False)):
        def rec_name(x: bool) -> str:
            return "the final HC state recorded (the MTP drafter's input)" if x else "no final HC state recorded"

        how = "with --draft mtp" if record_hc else "without --draft mtp"
        raise ArtifactError(f"artifact {artifact} was compiled with {rec_name(bool(man.get('record_hc')))}, asked to "
                            f"serve a step with {rec_name(bool(record_hc))}; compile one {how} (`ds4c compile`)")
    if isinstance(prefill_chunks, str) or not all(type(n) is int for n in (prefill_chunks or ())):
        raise ArtifactError(f"check_serves: prefill_chunks must be chunk sizes (ints), found {prefill_chunks!r}")
    want_chunks = sorted(set(prefill_chunks or ()))
    have_chunks = list(manifest_prefill_chunks(man))
    lacking = [n for n in want_chunks if n not in have_chunks]
    if lacking:
        had = f"with --prefill {chunks_text(have_chunks)}" if have_chunks else "without --prefill (no chunk graphs)"
        raise ArtifactError(f"artifact {artifact} was compiled {had}; asked for {chunks_text(want_chunks)} (it "
                            f"lacks the chunk graphs of {chunks_text(lacking)}): compile one with --prefill "
                            f"{chunks_text(sorted(set(have_chunks) | set(want_chunks)))} (`ds4c compile`) or ask "
                            f"for {'a subset of its chunks' if have_chunks else 'no prefill chunks'}")
    types = effective_weight_types(cfg, weight_types)
    diff = first_format_difference(man["weight_types"], types)
    if diff is not None:
        name, want, got, n = diff
        raise ArtifactError(f"{where}: tensor {name} is {want} in the artifact's weight formats, {got} in the "
                            f"model ({n} tensor{'s' * (n != 1)} differ); rebuild it with `ds4c compile` from this "
                            f"model file")
    for slug, t in man["targets"].items():
        for g in t["graphs"].values():
            for k in g["kernels"]:
                for ld in k["launches"]:
                    _check_launch_formats(ld["args"], t["binaries"][ld["binary"]], ld["binary"], types, where)


def check_lowering(man: dict[str, Any], artifact: str | os.PathLike, cfg: Ds4Config, weight_types: dict) -> int:
    """Pair every graph of every target of the artifact with this model's lowering, as the runtime does before it
    loads a graph (:func:`launch_binaries`): the same plan kernels and launches in the same order, each binary
    rendered for the formats its launch reads. Runs the pass pipeline and the lowering for each (width,
    context) step graph and each prefill chunk graph (CPU only; seconds for a 43-layer model). Returns the number
    of launches checked.

    Raises:
        ArtifactError: the first graph whose kernels, launches or weight formats differ.
    """
    b = manifest_buckets(man)
    n = 0
    taps, rec = tuple(man.get("taps", ())), bool(man.get("record_hc", False))
    todo = [(shard, layers, width, context, False) for shard, layers in split_ranges(cfg, man.get("layer_split"))
            for width, context in b.keys()]
    todo += [(None, None, rows, context, True) for rows, context in prefill_keys(manifest_prefill_chunks(man),
                                                                                b.contexts)]
    for shard, layers, width, context, chunk in todo:
        g = run_pipeline(build_step(cfg, width, b.contexts[-1], layers, taps=taps, record_hc=rec, prefill=chunk),
                         "default", context=context).graph
        for slug, t in man["targets"].items():
            tgt = Target(t["vendor"], t["arch"], t["wave"])
            n += len(launch_binaries(man, artifact, slug, width, context, lower.lower_graph(g, cfg, tgt, weight_types),
                                     weight_types, shard, prefill=chunk))
    return n


def _check_launch_formats(args: list, rec: dict[str, Any], rel: str, types: dict[str, str], where: str) -> None:
    """The binary ``rel`` (record ``rec``) was rendered for the formats a launch with ``args`` reads."""
    found = weight_formats(args, types)
    if found == rec["weights"]:
        return
    names = [a["name"] if isinstance(a, dict) else a.name for a in args
             if (a["kind"] if isinstance(a, dict) else a.kind) == "weight"]
    i = next((i for i, (x, y) in enumerate(zip(rec["weights"], found)) if x != y), min(len(found), len(rec["weights"])))
    name = names[i] if i < len(names) else "?"
    want = rec["weights"][i] if i < len(rec["weights"]) else "absent"
    got = found[i] if i < len(found) else "absent"
    raise ArtifactError(f"{where}: binary {rel} was rendered for tensor {name} as {want}, the model has {got}; "
                        f"rebuild it with `ds4c compile` from this model file")


_REBUILD = ("built by another ds4c, or with other kernel settings such as DS4C_PREFILL_ATTN_MMA or "
            "DS4C_PREFILL_GEMM_BN: `ds4c info --env` lists them; compile again with this ds4c and these settings")


def launch_binaries(man: dict[str, Any], artifact: str | os.PathLike, arch: str, width: int, context: int,
                    kernels: list, weight_types: dict, shard: int | None = None,
                    prefill: bool = False) -> list[Path]:
    """The binary of every launch of ``kernels`` (``lower_graph`` of the (width, context) graph for ``arch``),
    in launch order, from an artifact: the runtime's path that needs no compiler. ``shard``: the graph of that
    shard of the artifact's layer split. ``prefill``: the prefill chunk graph of ``width`` = C rows (key
    ``p{C}_c{context}``; ``CompiledStep`` passes it for its ``prefill_chunks`` keys).

    The lowering is deterministic, so the manifest lists the same plan kernels and launches in the same order;
    each pairing is checked by plan-kernel name and entry point, and by the weight formats each launch reads in
    this model (``weight_types``: ``{tensor name: GGMLType}``) against those its binary was rendered for.

    Raises:
        ArtifactError: the artifact has no binaries for ``arch``, no graph for (width, context) — the message
            names the missing key — or its launches do not match the lowering (built by another ds4c or for
            another model), or a binary was rendered for other weight formats (naming the tensor), or was compiled
            from another source than the lowering renders (a kernel setting such as a tile width differs from the
            compile's: the lowering's grid and block would run another kernel's body).
    """
    types = {k: getattr(v, "name", str(v)) for k, v in weight_types.items()}
    slug = find_target(man, arch)
    key = graph_key(width, context, shard, prefill)
    graphs = man["targets"][slug]["graphs"]
    if key not in graphs:
        what = f"prefill chunk graph {key} ({width} rows" if prefill else f"step graph {key} (width {width}"
        raise ArtifactError(f"the artifact has no {what}, context {context}"
                            f"{'' if shard is None else f', shard {shard}'}) for {slug}: it has {', '.join(graphs)}")
    listed = graphs[key]["kernels"]
    if [k["name"] for k in listed] != [k.name for k in kernels]:
        raise ArtifactError(f"artifact graph {key} for {slug} lists other plan kernels than this model's lowering; "
                            f"rebuild it with `ds4c compile` for this model")
    out = []
    binaries = man["targets"][slug]["binaries"]
    for k, rec in zip(kernels, listed):
        if [l["entry"] for l in rec["launches"]] != [la.kernel.entry for la in k.launches]:
            raise ArtifactError(f"artifact kernel {k.name} ({key}, {slug}) has other launches than the lowering "
                                f"({_REBUILD})")
        for l, la in zip(rec["launches"], k.launches):
            b = binaries[l["binary"]]
            _check_launch_formats(la.args, b, l["binary"], types, f"artifact {artifact} does not serve this model")
            # the launch's grid, block and shared memory come from this lowering: its binary must be of the same
            # source (a setting that shapes kernels, e.g. a tile width, can change a source but not its entry name)
            if b["source_sha256"] != la.kernel.digest():
                raise ArtifactError(f"artifact kernel {k.name} ({key}, {slug}): binary {l['binary']} was compiled "
                                    f"from another source than this lowering renders ({_REBUILD})")
        out += [Path(artifact) / l["binary"] for l in rec["launches"]]
    return out
