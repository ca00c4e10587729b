"""``ds4c inspect-ir``: the step IR (or a prefill chunk's) after the chosen passes (:func:`ds4c.ir.build_step`,
:func:`ds4c.passes.manager.run_pipeline`) and a per-layer kernel-plan summary
(:func:`ds4c.passes.partition.kernel_plan`)."""

from __future__ import annotations

import click

from ds4c.cli.shell import model_path, parse_ints, tap_layers
from ds4c.config import MAX_PREFILL_ROWS, PRESETS
from ds4c.errors import Ds4cError
from ds4c.tempfiles import write_text_atomic


@click.command("inspect-ir")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--preset", "preset_name", type=click.Choice(list(PRESETS)), default=None,
              help="Inspect a preset's step without a model file (weight bytes then assume official formats).")
@click.option("--width", type=click.IntRange(1, 5), default=1, show_default=True, help="Step width q.")
@click.option("--prefill", "prefill", type=click.IntRange(1, MAX_PREFILL_ROWS), default=None,
              help="Print the prefill chunk graph of C rows instead of a step (padded rows masked by n_valid; "
                   "the head reads the last valid row). The IR takes any C; the compiled chunk graphs (compile / "
                   "generate --prefill) start at 16 rows.")
@click.option("--max-ctx", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--context", type=int, default=None, help="Context bucket (default: the largest).")
@click.option("--pipeline", default="default", show_default=True, help="Pipeline name.")
@click.option("--after", "after", default=None, help="Print the IR after this pass.")
@click.option("--all", "print_all", is_flag=True, help="Print the IR after every pass.")
@click.option("--layers", default=None, help="Only print these layers' ops, e.g. 0,1 (-1 = embedding/head).")
@click.option("--dot", "dot", type=click.Path(dir_okay=False), default=None, help="Write Graphviz dot here.")
@click.option("--taps", "taps", default=None, metavar="L,L,...",
              help="Build the graph with the DSpark taps of these layers (e.g. 40,41,42): the dspark_tap op.")
@click.option("--record-hc", "record_hc", is_flag=True,
              help="Build the graph recording the final HC state for the MTP drafter (spec 7.5): the record_hc op.")
@click.option("--lanes", "lanes", default=None, metavar="N or R,R,...",
              help="Print a lanes step (docs/batching.md): N sequences of one decode row each, or the rows of each "
                   "lane (e.g. 1,3,1: a verify lane of 3 rows between two decode lanes; a single number is always "
                   "that many one-row lanes); at most 16 rows.")
def command(file: str | None, preset_name: str | None, width: int, prefill: int | None, max_ctx: int,
            context: int | None, pipeline: str, after: str | None, print_all: bool, layers: str | None,
            dot: str | None, taps: str | None, record_hc: bool, lanes: str | None) -> None:
    """Print the step IR (or a prefill chunk's, --prefill C) after the chosen passes and a per-layer
    kernel-plan summary."""
    # start-up speed: the model stack (torch) loads only when the command runs
    from ds4c.buckets import BucketSpec
    from ds4c.config import preset
    from ds4c.sources import open_model
    from ds4c.ir import build_step, print_graph
    from ds4c.ir.export import to_dot
    from ds4c.passes.manager import PIPELINES, run_pipeline
    from ds4c.passes.partition import kernel_plan, plan_weight_types
    from ds4c.tensors import storage_types

    if file and preset_name:
        raise click.UsageError("give a model file or --preset, not both")
    if preset_name:
        cfg = preset(preset_name)
        types = storage_types(cfg, "official")
    else:
        mf = open_model(model_path(file))
        cfg = mf.config
        types = {name: mf.ggml_type(name) for name in mf.specs}
    types = plan_weight_types(cfg, types)
    if prefill is not None and width != 1:
        raise click.UsageError("give --width (a decode / verify step) or --prefill (a prefill chunk), not both")
    if prefill is not None and prefill > max_ctx:
        raise click.BadParameter(f"a prefill chunk of {prefill} rows is longer than the context ({max_ctx})",
                                 param_hint="--prefill")
    lane_rows = None
    if lanes is not None:
        if prefill is not None or width != 1 or taps or record_hc:
            raise click.UsageError("--lanes takes no --width, --prefill, --taps or --record-hc")
        from ds4c.ir.builder import MAX_LANE_ROWS

        counts = parse_ints(lanes, "--lanes")
        if len(counts) == 1 and not 1 <= counts[0] <= MAX_LANE_ROWS:
            raise click.BadParameter(f"{lanes.strip()}: expected 1..{MAX_LANE_ROWS} lanes (one decode row each), or "
                                     f"the rows of each lane like 1,3,1", param_hint="--lanes")
        lane_rows = tuple([1] * counts[0]) if len(counts) == 1 else tuple(counts)
    buckets = BucketSpec.build(cfg, (width,), max_ctx)
    ctx = context if context is not None else buckets.contexts[-1]
    if ctx not in buckets.contexts:
        raise Ds4cError(f"--context {ctx} is not a bucket: expected one of {list(buckets.contexts)}")
    names = PIPELINES.get(pipeline)
    if names is None:
        raise Ds4cError(f"unknown pipeline {pipeline!r}: expected one of {sorted(PIPELINES)}")
    if after is not None and after not in names:
        raise Ds4cError(f"--after {after!r} is not a pass of pipeline {pipeline!r}: expected one of {list(names)}")
    cap = buckets.contexts[-1]  # state capacity: the largest bucket (>= max_ctx), as compiled artifacts hold
    taps_ = tap_layers(cfg, taps, None)
    if lane_rows is not None:
        g0 = build_step(cfg, sum(lane_rows), cap, lanes=lane_rows)
    elif prefill is not None:
        g0 = build_step(cfg, prefill, cap, prefill=True, taps=taps_, record_hc=record_hc)
    else:
        g0 = build_step(cfg, width, cap, taps=taps_, record_hc=record_hc)
    want = "all" if print_all else ([after] if after else [])
    res = run_pipeline(g0, names, context=ctx, print_after=want)
    only = set(parse_ints(layers, "--layers")) if layers else None
    if only and any(not -1 <= i < cfg.n_layers for i in only):
        raise click.BadParameter(f"layers must be in -1..{cfg.n_layers - 1} (-1 = embedding/head), found "
                                 f"{sorted(only)}", param_hint="--layers")
    if print_all or after:
        for name, snap in res.snapshots.items():
            click.echo(f"// ---- IR after {name}")
            click.echo(print_graph(snap, only))
    if dot:
        write_text_atomic(dot, to_dot(res.graph))
        click.echo(f"wrote {dot}", err=True)
    what = f"prefill chunk of {prefill} rows" if prefill is not None else f"width {width}"
    if lane_rows is not None:
        n, r = len(lane_rows), sum(lane_rows)
        what = f"{n} lane{'s' * (n > 1)} of rows {list(lane_rows)} ({r} row{'s' * (r > 1)})"
    click.echo(f"// {cfg.name}, {what}, context bucket {ctx}, max_ctx {max_ctx}")
    click.echo("// pass                 seconds  top-level ops  leaf ops")
    for r in res.records:
        click.echo(f"//   {r.name:18s} {r.seconds:8.4f} {r.top_ops:14d} {r.leaf_ops:9d}")
    if "partition" not in names:
        return
    plan = kernel_plan(res.graph, types, cfg.n_active_experts)
    ops_before: dict[int, int] = {}
    for op in g0.ops:
        ops_before[op.layer] = ops_before.get(op.layer, 0) + (op.kind != "param")
    click.echo("// layer kind kernels ops(before)  weight MB  kernels (weight MB)")
    for layer, ks in sorted(plan.per_layer().items()):
        kind = cfg.layer_kind(layer).upper() if layer >= 0 else "HEAD"
        mb = sum(k.weight_bytes for k in ks) / 1e6
        detail = ", ".join(f"{k.name.split('.', 1)[-1]}({k.weight_bytes / 1e6:.1f})" for k in ks)
        click.echo(f"//   {layer:3d} {kind:4s} {len(ks):7d} {ops_before.get(layer, 0):11d} {mb:10.1f}  {detail}")
    mem = res.graph.meta.get("memory", {})
    click.echo(f"// kernels {len(plan.kernels)}, weight bytes/step {sum(k.weight_bytes for k in plan.kernels) / 1e9:.3f} GB "
               f"(routed experts: the {cfg.n_active_experts} of one row; a wider step reads more), arena {mem.get('arena_bytes', 0):,d} bytes "
               f"(without reuse {mem.get('no_reuse_bytes', 0):,d})")
