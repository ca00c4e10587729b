"""``ds4c compile``: an ahead-of-time artifact of every (width, context) step graph for the given archs
(:func:`ds4c.runtime.artifact.build_artifact`, which owns the rules of what an artifact may hold: prefill chunk
graphs only for the unsplit step without taps or the final HC state, chunks no longer than ``--max-ctx``)."""

from __future__ import annotations

import click

from ds4c.cli.shell import model_path, parse_ints, prefill_chunks_option, tap_layers
from ds4c.config import PRESETS
from ds4c.errors import Ds4cError


@click.command("compile")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--preset", "preset_name", type=click.Choice(list(PRESETS)), default=None,
              help="Compile a preset's model without a model file.")
@click.option("--arch", "archs", required=True, help="Comma-separated target archs, e.g. sm_90,gfx1151.")
@click.option("--widths", default="1,2,3,4,5", show_default=True, help="Comma-separated verify widths (1..5).")
@click.option("--max-ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Largest context (tokens) the artifact serves.")
@click.option("--contexts", default=None, help="Comma-separated context buckets (default: powers of two).")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Parallel compiles (default: CPU count).")
@click.option("--layer-split", "layer_split", default=None, metavar="N,N,...",
              help="Compile the graphs of this layer split (layers per shard, e.g. 22,21) instead of the unsplit "
                   "step: the artifact then serves generate/bench with the same --layer-split.")
@click.option("--taps", "taps", default=None, metavar="L,L,...",
              help="Record the DSpark taps of these layers (0-based, in the drafter's order, e.g. 40,41,42) in "
                   "every graph: the artifact then serves a compiled step with exactly these taps.")
@click.option("--draft", "draft", default=None, metavar="FILE",
              help="Take --taps from this DSpark drafter file (its target layers, dflash.target_layers), checked "
                   "against the model (make one with make-model --drafter dspark), or from the synthetic drafter "
                   "dspark:synthetic:PRESET[:FORMATS[:SEED]]; or mtp (also mtp:PATH): every graph records the "
                   "final HC state the MTP drafter reads (spec 7.5; generate --draft mtp on the compiled engine).")
@click.option("--prefill", "prefill", default=None, metavar="C,C,...",
              help="Also compile the prefill chunk graphs of these row counts (e.g. 256,2048; each in 16..4096 and "
                   "<= --max-ctx): one per chunk size and context bucket >= it; the artifact then serves generate "
                   "--prefill with these sizes (or fewer), and generate --artifact uses them by default. Not with "
                   "--layer-split, --taps or --draft.")
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True, help="Artifact folder.")
def command(file: str | None, preset_name: str | None, archs: str, widths: str, max_ctx: int,
            contexts: str | None, jobs: int | None, layer_split: str | None, taps: str | None,
            draft: str | None, prefill: str | None, output: str) -> None:
    """Compile every (width, context) step graph for the given archs into an artifact folder (no GPU needed).

    The config comes from FILE, or --preset, or the built-in default model. Kernels come from (and go to) the
    kernel cache; the artifact is replaced atomically. With --taps (or --draft) every graph also records the
    DSpark taps (spec 5.2(q)) for the compiled drafter; an artifact serves only a step with its own taps. With
    --draft mtp (or mtp:PATH) every graph holding the last layer records the final HC state (spec 7.5) for the MTP
    drafter; an artifact serves only a step that records it as it does. With --prefill C,C the artifact also holds
    the prefill chunk graphs of those row counts (docs/prefill.md), for every context bucket >= C.
    """
    # start-up speed: the model stack (torch) loads only when the command runs
    from ds4c.buckets import BucketSpec
    from ds4c.config import preset
    from ds4c.sources import open_model
    from ds4c.runtime.artifact import build_artifact
    from ds4c.runtime.artifact_manifest import load_manifest
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.targets import parse_targets
    from ds4c.shard_plan import parse_plan

    if file and preset_name:
        raise click.UsageError("give a model file or --preset, not both")
    if not output.strip():
        raise Ds4cError("-o: expected an artifact folder path, found ''")
    targets = parse_targets(archs)
    ws = parse_ints(widths, "--widths")
    cs = parse_ints(contexts, "--contexts") if contexts is not None else None
    chunks: tuple[int, ...] = ()
    if prefill is not None:  # read before the model is opened or anything lowered
        chunks = prefill_chunks_option(prefill, "--prefill")
        if not chunks:
            raise Ds4cError(f"--prefill: expected chunk sizes such as 256,2048, found {prefill!r}")
    if preset_name:
        cfg, types = preset(preset_name), None
    else:
        mf = open_model(model_path(file))
        cfg, types = mf.config, {name: mf.ggml_type(name) for name in mf.specs}
    buckets = BucketSpec.build(cfg, ws, max_ctx, cs)
    split = None
    if layer_split is not None:
        n = len(layer_split.split(","))
        split = parse_plan(["cuda"] * n, layer_split, cfg.n_layers).layers
    record_hc = draft is not None and (draft == "mtp" or draft.startswith("mtp:"))
    taps_ = tap_layers(cfg, taps, None if record_hc else draft)
    out = build_artifact(cfg, targets, buckets, output, KernelCache(), jobs=jobs, weight_types=types,
                         layer_split=split, taps=taps_, record_hc=record_hc, prefill_chunks=chunks)
    man = load_manifest(out, verify=False)
    b = man["build"]
    tinfo = man["targets"]
    click.echo(f"artifact:  {out}")
    click.echo("targets:   " + ", ".join(f"{s} ({t['toolchain']['name']} {t['toolchain']['version'].split(' (')[0]})"
                                         for s, t in tinfo.items()))
    n_chunk = sum(1 for g in man["graphs"].values() if g.get("prefill"))
    click.echo(f"graphs:    {len(man['graphs']) - n_chunk} per target (widths {','.join(map(str, buckets.widths))} x "
               f"contexts {','.join(map(str, buckets.contexts))}, max_ctx {buckets.max_ctx}"
               + (f"; layer split {','.join(map(str, split))}: one graph per shard" if split else "") + ")")
    if chunks:
        click.echo(f"prefill:   {n_chunk} chunk graph{'s' * (n_chunk != 1)} per target (chunks "
                   f"{','.join(map(str, chunks))} x the context buckets >= each; keys p<C>_c<context>)")
    if taps_:
        click.echo(f"taps:      DSpark taps of layers {','.join(map(str, taps_))}")
    if record_hc:
        click.echo("final HC:  every graph records the final HC state (spec 7.5; the MTP drafter's input)")
    click.echo(f"kernels:   {b['plan_kernels']} plan kernels, {b['launches']} launches")
    click.echo(f"binaries:  {b['unique_binaries']} unique: compiled {b['compiled']}, cached {b['cached']}")
    click.echo(f"seconds:   {b['seconds']:.1f}")
