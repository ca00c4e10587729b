"""``ds4c info``: what a model file holds (:class:`ds4c.gguf_file.ModelFile`), its compiled step's memory plan
(``--plan``, :func:`ds4c.engine.plan_memory`), or the environment settings in force (``--env``,
:mod:`ds4c.settings`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from ds4c.cli.shell import given_on_command_line, model_path, split_options
from ds4c.errors import Ds4cError
from ds4c.settings import describe


def _finite_gib(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value <= 1 << 20):
        raise click.BadParameter(f"expected a finite size in GiB (at most {1 << 20}), found {value}")
    return value


@click.command("info")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record.")
@click.option("--plan", "show_plan", is_flag=True,
              help="Print instead the compiled step's memory plan (weights by kind, state per bucket, arena, "
                   "graphs; no GPU needed) and, when free memory is known, whether it fits (exit 2 with the "
                   "refusal line if not).")
@click.option("--env", "show_env", is_flag=True,
              help="Print instead every DS4C_* environment setting: its value, what ds4c uses, the default and "
                   "what it does (docs/settings.md).")
@click.option("--max-ctx", type=click.IntRange(1), default=4096, show_default=True, help="--plan: context served.")
@click.option("--free-gib", type=click.FloatRange(min=0, min_open=True), default=None, callback=_finite_gib,
              help="--plan: free memory of each device in GiB (default: the CUDA devices' free memory now; "
                   "without a GPU, unknown).")
@click.option("--arch", default="sm_90", show_default=True, help="--plan: the CUDA arch to lower for.")
@split_options
def command(file: str | None, as_json: bool, show_plan: bool, show_env: bool, max_ctx: int, free_gib: float | None,
            arch: str, devices: str | None, layer_split: str | None) -> None:
    """Print the config, the kind of every layer, and tensor counts and bytes per type (a DSpark drafter file:
    its stages, taps, block size and heads). FILE may be synthetic:PRESET[:FORMATS[:SEED]] (a synthetic model) or
    dspark:synthetic:PRESET[:FORMATS[:SEED]] (its synthetic DSpark drafter)."""
    # start-up speed: the model stack (torch) loads only when the command runs
    from ds4c.config import absent_keys_text, rope_scaling_text
    from ds4c.gguf_file import ArchitectureError
    from ds4c.sources import open_model

    plan_only = [f"--{n.replace('_', '-')}" for n in ("max_ctx", "free_gib", "arch", "devices", "layer_split")
                 if given_on_command_line(n)]
    if show_env:
        if file or show_plan or plan_only:
            raise click.UsageError("--env prints the environment settings alone: drop FILE, --plan and its options")
        return _info_env(as_json)

    def dspark(path: str) -> None:
        if show_plan:  # the drafter's compiled graphs live in the target's engine (runtime/dspark_exec.py)
            raise Ds4cError(f"{path}: a DSpark drafter has no compiled step of its own to plan (--plan): plan its "
                            f"target model instead")
        return _info_dspark(path, as_json)

    if file and file.startswith("dspark:synthetic:"):
        return dspark(file[len("dspark:"):])
    try:
        mf = open_model(model_path(file), allow_mtp_only=True)
    except ArchitectureError as e:
        if e.arch != "dflash":
            raise
        return dspark(model_path(file))
    if show_plan:
        return _info_plan(mf, as_json, max_ctx, free_gib, arch, devices, layer_split)
    if plan_only:
        raise click.UsageError(f"{', '.join(plan_only)}: {'these apply' if len(plan_only) > 1 else 'applies'} only "
                               f"with --plan")
    cfg = mf.config
    layers = [] if mf.mtp_only else [
        {"layer": i, "kind": cfg.layer_kind(i), "compress_ratio": cfg.ratio(i),
         "router": "hash" if cfg.is_hash_layer(i) else "scored"} for i in range(cfg.n_layers)]
    by_type = mf.weight_bytes_by_type()
    mtp = _mtp_summary(mf)
    if as_json:
        click.echo(json.dumps({"file": str(mf.path), "file_type": mf.file_type, "tokenizer": _tokenizer_summary(mf),
                               "mtp": mtp, "extra_tensors": mf.extra_tensors,
                               "legacy_names": mf.legacy_names, "absent_keys": mf.absent_keys,
                               "rope_scaling": rope_scaling_text(cfg), "config": cfg.model_dict(), "config_hash": cfg.hash(),
                               "layers": layers, "tensors": {k: {"count": n, "bytes": b}
                                                             for k, (n, b) in by_type.items()}}))
        return
    click.echo(f"file: {mf.path}")
    click.echo(f"file type: {mf.file_type}; {mf.n_tensors} tensors, {len(mf.extra_tensors)} not read by ds4c"
               + (f" ({', '.join(mf.extra_tensors[:4])}{', ...' if len(mf.extra_tensors) > 4 else ''})"
                  if mf.extra_tensors else ""))
    tok = _tokenizer_summary(mf)
    click.echo("tokenizer: " + (f"{tok['model']} (pre {tok['pre']}), {tok['size']:,d} tokens, bos {tok['bos']}, "
                                f"eos {tok['eos']}, {tok['n_special']} special, chat template "
                                f"{'present' if tok['chat_template'] else 'absent'}" if tok else
                                "none (ids only: --prompt-ids)"))
    if mtp:
        click.echo(("MTP-only file (convert --mtp; the speculative-decoding draft of a "
                    f"{cfg.n_layers}-layer trunk, not a model): " if mtp["mtp_only"] else "MTP: ")
                   + "; ".join(f"blk.{b['block']} nextn ({b['n_tensors']} tensors, {b['bytes']:,d} bytes, "
                               f"ratio {b['compress_ratio']}): " + ", ".join(f"{k} {t}" for k, t in b["nextn"].items())
                               for b in mtp["blocks"]))
    click.echo(f"rope scaling: {rope_scaling_text(cfg)}")
    if mf.absent_keys:
        click.echo(f"metadata: {absent_keys_text(mf.absent_keys)}")
    if mf.legacy_names:
        click.echo(f"layout: ds4c 0.1 names for {len(mf.legacy_names)} HC tensors (read as the converter names "
                   f"them; `ds4c make-model` writes the current layout)")
    click.echo(f"config ({cfg.name}, hash {cfg.hash()[:12]}):")
    for k, v in cfg.model_dict().items():
        if k != "compress_ratios":
            click.echo(f"  {k:20s} {v}")
    click.echo("layers:" if layers else "layers: none (MTP-only file)")
    for li in layers:
        click.echo(f"  {li['layer']:3d}  {li['kind'].upper():3s}  ratio {li['compress_ratio']:<4d} router {li['router']}")
    click.echo("tensors by type:")
    total_n = total_b = 0
    for k, (n, b) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        click.echo(f"  {k:6s} {n:6d} tensors  {b:>16,d} bytes  ({b / 2**30:8.3f} GiB)")
        total_n += n
        total_b += b
    click.echo(f"  {'total':6s} {total_n:6d} tensors  {total_b:>16,d} bytes  ({total_b / 2**30:8.3f} GiB)")


def _info_env(as_json: bool) -> None:
    """``ds4c info --env``: every setting of :mod:`ds4c.settings` with its value now."""
    rows = describe()
    if as_json:
        click.echo(json.dumps({"env": rows}))
        return
    table = [("variable", "in use", "set to", "default", "what it does")] + [
        (r["name"], r["used"], "(unset)" if r["value"] is None else repr(r["value"]), r["default"], r["doc"])
        for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(4)]
    for row in table:
        click.echo("  ".join(f"{c:{w}s}" for c, w in zip(row[:4], widths)) + "  " + row[4])


def _info_plan(mf, as_json: bool, max_ctx: int, free_gib: float | None, arch: str, devices: str | None,
               layer_split: str | None) -> None:
    """``ds4c info --plan``: the memory plan (arithmetic), checked when the free memory is known."""
    from ds4c.engine import plan_memory  # start-up speed

    mp = plan_memory(mf, max_ctx, arch, devices, layer_split, free_gib)
    if as_json:
        click.echo(json.dumps({"memory_plan": mp.as_dict()}))
    else:
        click.echo(mp.describe())
    mp.check()


def _info_dspark(path: Path | str, as_json: bool) -> None:
    """``ds4c info`` of a DSpark drafter file or synthetic drafter spec (spec section 7)."""
    from ds4c.drafters.dspark_sources import open_dspark  # start-up speed

    f = open_dspark(path)
    path = f.path
    cfg = f.config
    rec = {"file": str(path), "kind": "dspark drafter", "stages": cfg.n_layers, "taps": list(f.taps),
           "block_size": f.block_size, "noise_id": f.noise_id, "markov_rank": f.markov_rank,
           "config": cfg.model_dict()}
    if as_json:
        click.echo(json.dumps(rec))
        return
    click.echo(f"file: {path}")
    click.echo(f"DSpark drafter (arch dflash, spec section 7): {cfg.n_layers} stages (hidden {cfg.hidden_size}, "
               f"{cfg.n_experts} experts, window {cfg.window}); taps of target layers {list(f.taps)}; block size "
               f"{f.block_size}; noise token {f.noise_id}; Markov head rank {f.markov_rank}; vocabulary "
               f"{cfg.vocab_size}")


def _mtp_summary(mf) -> dict | None:
    """What ``ds4c info`` says of the file's MTP (nextn) blocks, or None when it has none."""
    if not mf.nextn_blocks:
        return None
    blocks = []
    for b in mf.nextn_blocks:
        specs = [s for s in mf.mtp_specs.values() if s.layer == b]
        nextn = {s.name.split(".nextn.", 1)[1].removesuffix(".weight"): mf.ggml_type(s.name).name
                 for s in specs if ".nextn." in s.name}
        blocks.append({"block": b, "n_tensors": len(specs), "bytes": sum(int(mf.raw(s.name).nbytes) for s in specs),
                       "compress_ratio": (mf.config.compress_ratios[b] if b < len(mf.config.compress_ratios) else 0),
                       "nextn": nextn})
    return {"mtp_only": mf.mtp_only, "blocks": blocks}


def _tokenizer_summary(mf) -> dict | None:
    """What ``ds4c info`` says of the file's tokenizer, or None when it has none."""
    from ds4c.tokenizer import Tokenizer, has_tokenizer  # start-up speed

    if not has_tokenizer(mf.metadata):
        return None
    tok = Tokenizer.from_metadata(mf.metadata, source=str(mf.path))
    return {"model": tok.model, "pre": tok.pre, "size": tok.vocab_size, "bos": tok.bos_id, "eos": tok.eos_id,
            "n_special": len(tok.specials), "chat_template": tok.chat_template is not None}
