"""``ds4c inspect``: an artifact folder built by ``ds4c compile`` (:mod:`ds4c.runtime.artifact`): its summary,
the kernels of a graph with their launches and resources, one kernel's source, resources or machine code, or
(``--model``) whether it serves a model file."""

from __future__ import annotations

from pathlib import Path

import click


def _layer_name(layer: int) -> str:
    return "emb/head" if layer < 0 else f"L{layer}"


def _res_text(res: dict) -> str:
    if not res:
        return "regs ? (not reported)"
    spill = res.get("spill_stores", 0) + res.get("spill_loads", 0) if "spill_stores" in res else \
        res.get("sgpr_spills", 0) + res.get("vgpr_spills", 0)
    return (f"regs {res.get('registers', '?')}, spills {spill}{' (!)' if res.get('spills') else ''}, "
            f"smem {res.get('smem_bytes', 0)}")


def _resources_of(rec: dict, entry: str) -> dict:
    r = rec.get("resources", {})
    if entry in r:
        return r[entry]
    return next(iter(r.values())) if len(r) == 1 else {}


@click.command("inspect")
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--kernels", "list_kernels", is_flag=True,
              help="Per layer the kernels with grid/block/smem and registers/spills/shared memory.")
@click.option("--kernel", "kernel", default=None,
              help="One kernel: a plan kernel (l0.multi_gemv), a rendered kernel or entry name, or a binary name.")
@click.option("--source", "show_source", is_flag=True, help="With --kernel: print the rendered source.")
@click.option("--resources", "show_resources", is_flag=True, help="With --kernel: print the resource usage.")
@click.option("--sass", "show_sass", is_flag=True,
              help="With --kernel: print the machine code (cuobjdump -sass / llvm-objdump -d).")
@click.option("--target", "arch", default=None, help="Target arch (default: the first of the artifact).")
@click.option("--graph", "graph", default=None, help="Graph key, e.g. q1_c256 (default: the first).")
@click.option("--model", "model", type=click.Path(dir_okay=False), default=None,
              help="Check (no GPU needed) that the artifact serves this GGUF: config, weight formats, every binary, "
                   "every graph paired with this model's lowering. "
                   "Exit 0 when it does, else a one-line error naming the first tensor whose format differs.")
def command(artifact: str, list_kernels: bool, kernel: str | None, show_source: bool, show_resources: bool,
                show_sass: bool, arch: str | None, graph: str | None, model: str | None) -> None:
    """Inspect an artifact folder built by `ds4c compile` (every load checks that manifest.json is unchanged)."""
    # start-up speed: the model stack (torch) loads only when the command runs
    from ds4c.runtime.artifact_inspect import disassemble, find_binaries
    from ds4c.runtime.artifact_manifest import find_graph, find_target, load_manifest
    from ds4c.runtime.artifact_serve import check_lowering, check_serves

    if sum((show_source, show_resources, show_sass)) > 1:
        raise click.UsageError("give at most one of --source, --resources, --sass")
    if (show_source or show_resources or show_sass) and kernel is None:
        raise click.UsageError("--source, --resources and --sass need --kernel NAME")
    if model is not None and (list_kernels or kernel is not None or arch is not None or graph is not None):
        raise click.UsageError("--model checks the whole artifact: give it alone")
    man = load_manifest(artifact)
    if model is not None:
        from ds4c.sources import open_model  # start-up speed

        mf = open_model(model)
        types = {n: mf.ggml_type(n) for n in mf.specs}
        check_serves(man, artifact, mf.config, types, layer_split=man.get("layer_split"), taps=man.get("taps", ()),
                     record_hc=bool(man.get("record_hc", False)))
        n_launch = check_lowering(man, artifact, mf.config, types)
        n_bin = sum(len(t["binaries"]) for t in man["targets"].values())
        click.echo(f"artifact {Path(artifact).absolute()} serves {mf.path}: config {man['config_hash'][:12]}, "
                   f"{len(man['weight_types'])} weight formats, {n_bin} binaries, {n_launch} launches paired with "
                   f"this model's lowering")
        return
    slug = find_target(man, arch)
    t = man["targets"][slug]
    if graph is not None:  # checked before anything is printed: an error comes alone
        find_graph(man, slug, graph)
    if kernel is not None:
        gk = find_graph(man, slug, graph)
        if graph is None and man.get("layer_split"):  # a split artifact: the first graph of the kernel's shard
            gk = next((k for k, g in t["graphs"].items() if any(x["name"] == kernel for x in g["kernels"])), gk)
        found = find_binaries(man, slug, gk, kernel)
        for i, (rel, rec) in enumerate(found):
            if len(found) > 1 or not (show_source or show_sass):
                click.echo(f"// ---- {rec['kernel']} (entry {rec['entry']}, family {rec['family']}) for {slug}: "
                           f"{rel}, key {rec['key'][:12]}")
            if show_source:
                click.echo((Path(artifact) / rec["source"]).read_text(), nl=False)
            elif show_sass:
                click.echo(disassemble(artifact, rel, rec, t["arch"]), nl=False)
            elif show_resources:
                res = rec.get("resources", {})
                if not res:
                    click.echo("  (none reported by the compiler)")
                for fn, use in res.items():
                    click.echo(f"  {fn}: " + ", ".join(f"{k} {v}" for k, v in use.items()))
            else:
                click.echo(f"  source:    {rec['source']}")
                click.echo(f"  binary:    {rel} ({rec['bytes']:,d} bytes, {rec['kind']})")
                click.echo(f"  resources: {_res_text(_resources_of(rec, rec['entry']))}")
        return
    if list_kernels:
        gk = find_graph(man, slug, graph)
        if graph is None and man.get("layer_split"):
            click.echo(f"// layer split {','.join(map(str, man['layer_split']))}: shard graphs "
                       f"{', '.join(k for k in t['graphs'] if k.endswith(gk.split('_', 1)[1]))} (--graph picks one)")
        g = t["graphs"][gk]
        what = f"prefill chunk of {g['width']} rows" if g.get("prefill") else f"width {g['width']}"
        click.echo(f"// {slug}, graph {gk} ({what}, context {g['context']}), arena "
                   f"{g['arena_bytes']:,d} bytes")
        by_layer: dict[int, list] = {}
        for k in g["kernels"]:
            by_layer.setdefault(k["layer"], []).append(k)
        for layer in sorted(by_layer):
            click.echo(f"{_layer_name(layer)}:")
            for k in by_layer[layer]:
                click.echo(f"  {k['name']}  ({k['family']}, {len(k['launches'])} launch"
                           f"{'es' if len(k['launches']) != 1 else ''})")
                for ld in k["launches"]:
                    rec = t["binaries"][ld["binary"]]
                    click.echo(f"    {ld['entry']:40s} grid {tuple(ld['grid'])} block {tuple(ld['block'])} "
                               f"dyn smem {ld['smem']}  {_res_text(_resources_of(rec, ld['entry']))}  "
                               f"[{Path(ld['binary']).name}]")
        return
    cfg = man["config"]
    bk = man["buckets"]
    click.echo(f"artifact: {Path(artifact).absolute()} (ds4c {man['ds4c_version']})")
    click.echo(f"config:   {cfg.get('name')} (hash {man['config_hash'][:12]}), {cfg.get('n_layers')} layers, "
               f"hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}")
    click.echo(f"buckets:  widths {bk['widths']}, contexts {bk['contexts']}, max_ctx {bk['max_ctx']} "
               f"(hash {man['buckets_hash'][:12]})")
    split = man.get("layer_split")
    if split:
        ranges, a = [], 0
        for k, n in enumerate(split):
            ranges.append(f"s{k} [{a},{a + n})")
            a += n
        click.echo(f"split:    layer split {','.join(map(str, split))}: {', '.join(ranges)} (graphs s<k>_q<w>_c<ctx>)")
    if man.get("taps"):
        click.echo(f"taps:     DSpark taps of layers {','.join(map(str, man['taps']))} "
                   f"(every graph writes the tap ring)")
    if man.get("record_hc"):
        click.echo("final HC: recorded (the last layer's graphs write the final HC ring; the MTP drafter's input)")
    if man.get("prefill_chunks"):
        pk = [k for k, g in man["graphs"].items() if g.get("prefill")]
        click.echo(f"prefill:  chunk graphs of {','.join(map(str, man['prefill_chunks']))} rows: {', '.join(pk)} "
                   f"(compiled with --prefill; generate --artifact prefills with them)")
    b = man.get("build", {})
    if b:
        click.echo(f"build:    {b.get('unique_binaries')} unique binaries ({b.get('compiled')} compiled, "
                   f"{b.get('cached')} cached) in {b.get('seconds')} s")
    for s, ti in man["targets"].items():
        if arch is not None and s != slug:
            continue
        nbytes = sum(r["bytes"] for r in ti["binaries"].values())
        click.echo(f"target {s} (wave {ti['wave']}, {ti['toolchain']['name']} {ti['toolchain']['version']}): "
                   f"{len(ti['binaries'])} binaries, {nbytes:,d} bytes")
        for gk, g in ti["graphs"].items():
            if graph is not None and gk != graph:
                continue
            per: dict[int, int] = {}
            for k in g["kernels"]:
                per[k["layer"]] = per.get(k["layer"], 0) + 1
            n_l = sum(len(k["launches"]) for k in g["kernels"])
            layers = " ".join(f"{_layer_name(la)}:{n}" for la, n in sorted(per.items()))
            click.echo(f"  {gk:10s} kernels {len(g['kernels']):4d} launches {n_l:4d} arena {g['arena_bytes']:>12,d} B "
                       f"graph {g['graph_hash'][:12]}  per layer {layers}"
                       + (f"  (prefill chunk, {g['width']} rows)" if g.get("prefill") else ""))
