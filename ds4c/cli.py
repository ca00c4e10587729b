"""The ``ds4c`` command line (click).

Commands: ``make-model`` (synthetic GGUF), ``info`` (config, layer kinds, tensor bytes per type),
``generate`` (tokens from the reference), ``serve`` (OpenAI's API over HTTP, :mod:`ds4c.server`), ``inspect-ir``, ``export-mlir`` (the step as MLIR), ``compile`` (an AOT artifact), ``inspect`` (an
artifact: summary, kernels, source, resources, SASS/ISA), ``bench`` (one step: compiled vs torch eager vs
torch.compile vs the roofline), ``cache list|show|clear`` (the compiled-kernel cache). ``info`` and ``generate`` with no file use the built-in default
model: the ``tiny`` preset with seed 0, written once to the user cache folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import click

from ds4c import __version__
from ds4c.config import MAX_PREFILL_ROWS, PRESETS
from ds4c.errors import Ds4cError, GenerationInterrupted, StepError
from ds4c.write_errors import FULL_ERRNOS, write_error_text

DEFAULT_PRESET, DEFAULT_SEED = "tiny", 0
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT (128 + 2)


def default_model_path() -> Path:
    """Where the built-in default model lives (``$DS4C_HOME`` or ``~/.cache/ds4c``), created on first use.

    Creation is atomic (written to a temporary file, then renamed) and guarded by a file lock, so
    concurrent first uses end with one complete file."""
    from filelock import FileLock

    from ds4c.config import preset
    from ds4c.synth import make_model

    home = Path(os.environ.get("DS4C_HOME") or Path.home() / ".cache" / "ds4c")
    path = home / "models" / f"{DEFAULT_PRESET}-seed{DEFAULT_SEED}-v{__version__}.gguf"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(path.parent, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            where = "$DS4C_HOME" if os.environ.get("DS4C_HOME") else "the default cache folder (~/.cache/ds4c)"
            raise Ds4cError(f"cannot write the built-in default model under {where} = {home}: "
                            f"{e.strerror or e}; set DS4C_HOME to a writable folder") from None
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                click.echo(f"creating the built-in default model ({DEFAULT_PRESET}, seed {DEFAULT_SEED}) at {path}",
                           err=True)
                make_model(preset(DEFAULT_PRESET), path, seed=DEFAULT_SEED)
    return path


def _model_path(file: str | None) -> Path | str:
    """The model a command's FILE argument names: a path, a ``synthetic:...`` spec (kept as text), or the
    built-in default model."""
    if file and file.startswith("synthetic:"):
        return file
    return Path(file) if file else default_model_path()


class _Group(click.Group):
    """Turns ds4c errors into one clear line and exit status 2 (no traceback)."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a malformed option or argument: one line too, pointing at --help
            sub = e.ctx.command_path if e.ctx is not None else "ds4c"
            msg = " ".join(e.format_message().split())
            click.echo(f"ds4c: error: {msg} (see {sub} --help)", err=True)
            sys.exit(2)
        except Ds4cError as e:  # one line, whatever a file or manifest put into the message
            click.echo("ds4c: error: " + " ".join(str(e).split("\n")).replace("\r", " "), err=True)
            sys.exit(2)
        except KeyboardInterrupt:  # Ctrl-C outside a generation (which reports itself): one line, not "Aborted!"
            click.echo("\nds4c: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # output piped into e.g. `head`, which exited: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except OSError as e:  # file-system trouble outside ds4c's own checks (permissions, full disk)
            if e.errno in FULL_ERRNOS:  # name the path that could not be written (a copy's destination)
                click.echo(f"ds4c: error: {write_error_text(e)}", err=True)
            else:
                where = f": {e.filename}" if getattr(e, "filename", None) else ""
                where += f" -> {e.filename2}" if getattr(e, "filename2", None) else ""
                click.echo(f"ds4c: error: {e.strerror or e}{where}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="ds4c")
def main() -> None:
    """ds4c: compile and run DeepSeek-V4-Flash decode / verify steps."""


def _split_options(fn):
    """``--devices`` / ``--layer-split`` (a layer split, ``ds4c.shard_plan``) on a command."""
    fn = click.option("--layer-split", "layer_split", default=None, metavar="N,N,...",
                      help="Layers per shard, e.g. 22,21 (with --devices: one count per device; alone: every shard "
                           "on --device, a virtual split). Default with --devices: placed from the memory plan.")(fn)
    fn = click.option("--devices", "devices", default=None, metavar="DEV,DEV,...",
                      help="Run a layer split: one shard per device, e.g. cuda:0,cuda:1 (a device may repeat).")(fn)
    return fn


# ------------------------------------------------------------------------------------------------------
@main.command("make-model")
@click.option("--preset", "preset_name", type=click.Choice(list(PRESETS)), default="tiny",
              show_default=True, help="Model dimensions.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Random seed of the weights.")
@click.option("--formats", type=click.Choice(["official", "bf16", "f32", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                                             "iq4_xs"]), default="official", show_default=True,
              help="official: Q8_0 for FP8 weights, MXFP4 experts, BF16/F32 elsewhere; bf16: all BF16/F32; f32: all "
                   "F32 (the same model, for exact comparisons with other engines, docs/interop.md); q2_k .. iq4_xs: "
                   "official with the routed experts in that llama.cpp type (Q8_0 for rows not a multiple of 256).")
@click.option("--drafter", type=click.Choice(["dspark", "mtp"]), default=None,
              help="Write instead a synthetic drafter of the model this preset and seed make: dspark, the DSpark "
                   "drafter (spec section 7, llama.cpp's dflash layout; generate --draft FILE), or mtp, its MTP block "
                   "(spec 7.5, llama.cpp's convert --mtp layout; generate --draft mtp:FILE).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Output .gguf file.")
def make_model_cmd(preset_name: str, seed: int, formats: str, drafter: str | None, output: str) -> None:
    """Write a deterministic synthetic model (streams tensor by tensor; atomic)."""
    from ds4c.config import preset
    from ds4c.progress import progress_bar
    from ds4c.quant import nbytes
    from ds4c.synth import make_model
    from ds4c.tensors import storage_types, tensor_specs

    cfg = preset(preset_name)
    if drafter == "dspark":
        from ds4c.drafters.dspark_synth import make_dspark

        path = make_dspark(cfg, output, seed=seed, formats=formats)
        click.echo(f"wrote {path} ({path.stat().st_size / 1e9:.3f} GB, DSpark drafter of preset {preset_name} seed "
                   f"{seed}, formats {formats})")
        return
    if drafter == "mtp":
        from ds4c.drafters.mtp_synth import make_mtp

        path = make_mtp(cfg, output, seed=seed, formats=formats)
        click.echo(f"wrote {path} ({path.stat().st_size / 1e9:.3f} GB, MTP-only file of preset {preset_name} seed "
                   f"{seed}, formats {formats})")
        return
    types = storage_types(cfg, formats)
    total = sum(nbytes(types[s.name], s.shape) for s in tensor_specs(cfg))
    with progress_bar(total, f"{preset_name} -> {output}", "B", unit_scale=True, disable=total < (64 << 20)) as bar:
        path = make_model(cfg, output, seed=seed, formats=formats, progress=lambda s, n: bar.update(n))
    click.echo(f"wrote {path} ({path.stat().st_size / 1e9:.3f} GB, preset {preset_name}, seed {seed}, "
               f"formats {formats})")


# ------------------------------------------------------------------------------------------------------
def _finite_gib(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value <= 1 << 20):
        raise click.BadParameter(f"expected a finite size in GiB (at most {1 << 20}), found {value}")
    return value


@main.command("info")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record.")
@click.option("--plan", "show_plan", is_flag=True,
              help="Print instead the compiled step's memory plan (weights by kind, state per bucket, arena, "
                   "graphs; no GPU needed) and, when free memory is known, whether it fits (exit 2 with the "
                   "refusal line if not).")
@click.option("--max-ctx", type=click.IntRange(1), default=4096, show_default=True, help="--plan: context served.")
@click.option("--free-gib", type=click.FloatRange(min=0, min_open=True), default=None, callback=_finite_gib,
              help="--plan: free memory of each device in GiB (default: the CUDA devices' free memory now; "
                   "without a GPU, unknown).")
@click.option("--arch", default="sm_90", show_default=True, help="--plan: the CUDA arch to lower for.")
@_split_options
def info_cmd(file: str | None, as_json: bool, show_plan: bool, max_ctx: int, free_gib: float | None, arch: str,
             devices: str | None, layer_split: str | None) -> None:
    """Print the config, the kind of every layer, and tensor counts and bytes per type (a DSpark drafter file:
    its stages, taps, block size and heads). FILE may be synthetic:PRESET[:FORMATS[:SEED]] (a synthetic model) or
    dspark:synthetic:PRESET[:FORMATS[:SEED]] (its synthetic DSpark drafter)."""
    from ds4c.config import absent_keys_text, rope_scaling_text
    from ds4c.gguf_file import ArchitectureError
    from ds4c.sources import open_model

    def dspark(path: str) -> None:
        if show_plan:  # the drafter's compiled graphs live in the target's engine (runtime/dspark_exec.py)
            raise Ds4cError(f"{path}: a DSpark drafter has no compiled step of its own to plan (--plan): plan its "
                            f"target model instead")
        return _info_dspark(path, as_json)

    if file and file.startswith("dspark:synthetic:"):
        return dspark(file[len("dspark:"):])
    try:
        mf = open_model(_model_path(file), allow_mtp_only=True)
    except ArchitectureError as e:
        if e.arch != "dflash":
            raise
        return dspark(_model_path(file))
    if show_plan:
        return _info_plan(mf, as_json, max_ctx, free_gib, arch, devices, layer_split)
    ctx = click.get_current_context()
    given = [f"--{n.replace('_', '-')}" for n in ("max_ctx", "free_gib", "arch", "devices", "layer_split")
             if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{', '.join(given)}: {'these apply' if len(given) > 1 else 'applies'} only with --plan")
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


def _info_plan(mf, as_json: bool, max_ctx: int, free_gib: float | None, arch: str, devices: str | None,
               layer_split: str | None) -> None:
    """``ds4c info --plan``: the memory plan (arithmetic), checked when the free memory is known."""
    import torch

    from ds4c.buckets import BucketSpec
    from ds4c.engine import COMPILED_WIDTHS
    from ds4c.runtime.memory_plan import memory_model, memory_plan, plan_parts
    from ds4c.runtime.sharded import free_memory
    from ds4c.shard_plan import parse_counts, parse_plan

    if mf.mtp_only:
        raise Ds4cError(f"{mf.path}: an MTP-only file has no compiled step to plan")
    cfg = mf.config
    if max_ctx > cfg.max_position:
        raise Ds4cError(f"--max-ctx {max_ctx}: the model's context length is {cfg.max_position}")
    buckets = BucketSpec.build(cfg, COMPILED_WIDTHS, max_ctx)
    parts = plan_parts(mf, buckets, arch)
    devs = devices or ",".join(["cuda"] * (len(parse_counts(layer_split)) if layer_split else 1))
    probe = parse_plan(devs, layer_split, cfg.n_layers, default_device="cuda")
    if probe.kind != "cuda":
        raise Ds4cError(f"--devices {devs}: the memory plan is the compiled step's (CUDA devices)")
    if free_gib is not None:
        free = [int(free_gib * 2**30)] * probe.n_shards
    elif torch.cuda.is_available():
        free = free_memory(list(probe.devices))
    else:
        free = None
    plan = probe
    if devices and not layer_split and free is not None and probe.is_split:  # automatic placement
        plan = parse_plan(devs, None, cfg.n_layers, default_device="cuda", memory=memory_model(mf, buckets, arch, parts),
                          free_bytes=free)
    mp = memory_plan(mf, buckets, plan if plan.is_split else None, free, arch, parts)
    if as_json:
        click.echo(json.dumps({"memory_plan": mp.as_dict()}))
    else:
        click.echo(mp.describe())
    mp.check()


def _info_dspark(path: Path | str, as_json: bool) -> None:
    """``ds4c info`` of a DSpark drafter file or synthetic drafter spec (spec section 7)."""
    from ds4c.drafters.dspark_sources import open_dspark

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


def _prefill_chunks(text: str | None, device: str, engine: str, dataflow: str, artifact: str | None,
                    draft: str | None) -> tuple[int, ...]:
    """``--prefill``: the chunk sizes (:func:`~ds4c.buckets.check_prefill_chunks`), checked before the engine
    starts; one-line errors for the combinations the chunk graphs do not serve yet. ``none`` (or empty): ().
    Not given: None (the engine's default: an ``--artifact``'s own chunk graphs, else
    :data:`~ds4c.buckets.DEFAULT_PREFILL_CHUNKS`), or () with ``--draft`` (an artifact's chunk graphs record no
    taps or final HC state; a drafter's tapped chunk graphs are asked for explicitly). With ``--artifact`` the sizes must be among the artifact's
    (``check_serves`` says so in one line when the engine opens); ``--draft`` with ``--prefill`` builds the chunk
    graphs with the drafter's taps / final HC recording, so not from an artifact."""
    if text is None:
        return () if draft is not None else None
    from ds4c.buckets import check_prefill_chunks
    from ds4c.engine import resolve_engine

    try:
        chunks = check_prefill_chunks(text)
    except StepError as e:
        raise Ds4cError(f"--prefill: {e}") from None
    if not chunks:  # 'none': verify steps, on any engine
        return ()
    if draft is not None and artifact is not None:
        raise Ds4cError(f"--prefill {text} with --draft and --artifact: an artifact's chunk graphs record no taps or "
                        f"final HC state for a drafter; drop --artifact (the chunk graphs are then built here)")
    if resolve_engine(device, engine, dataflow) != "compiled":
        raise Ds4cError(f"--prefill {text}: prefill chunk graphs run on the compiled engine (--device cuda); found "
                        f"--device {device} --engine {engine}")
    return chunks


def _spec_width(text: str) -> int | str:
    """``--spec-width``: ``auto`` or an int 1..5 (one-line error otherwise)."""
    t = str(text).strip()
    if t == "auto":
        return t
    if not re.fullmatch(r"[1-5]", t):
        raise Ds4cError(f"--spec-width: expected 1..5 (verify rows per step) or auto, found {text!r}")
    return int(t)


def _device_of(device: str, devices: str | None) -> str:
    """The device kind of a ``--devices`` list (all cpu or all cuda) when ``--device`` was not given, else
    ``--device``, which must then agree with the list (one-line errors; an empty or mixed list is named by
    the shard plan)."""
    if devices is None:
        return device
    from ds4c.shard_plan import ShardPlanError, normalize_device

    kinds = {"cpu" if normalize_device(d) == "cpu" else "cuda" for d in devices.split(",") if d.strip()}
    if len(kinds) != 1:
        return device
    kind = kinds.pop()
    ctx = click.get_current_context(silent=True)
    given = ctx is not None and ctx.get_parameter_source("device") == click.core.ParameterSource.COMMANDLINE
    if given and kind != device:
        raise ShardPlanError(f"--devices {devices}: expected {device} devices (--device {device}), found {kind} "
                             f"devices")
    return kind


def _echo_prepare(st: dict | None) -> None:
    """The compiled engine's starting costs, once, on stderr (see CompiledStep.prepare_all)."""
    if not st:
        return
    w = st.get("weights") or {}
    click.echo(f"ready: {st['graphs']} graphs; build {st['build_s']:.1f} s, compile {st['compile_s']:.1f} s, load "
               f"{st['load_s']:.1f} s (weights {w.get('bytes', 0) / 1e9:.2f} GB at {w.get('gb_per_s', 0):.1f} GB/s), "
               f"capture {st['capture_s']:.1f} s; graphs take {st['graph_bytes'] / 2**20:.0f} MiB", err=True)
    for k, sh in enumerate(st.get("shards") or ()):  # a layer split: where each shard went, what it holds
        a, b = sh["layers"]
        click.echo(f"shard {k}: layers [{a},{b}) on {sh['device']}: weights {sh['weight_bytes'] / 2**30:.2f} GiB, "
                   f"graphs {sh['graph_bytes'] / 2**20:.0f} MiB", err=True)


def _tokenizer_summary(mf) -> dict | None:
    """What ``ds4c info`` says of the file's tokenizer, or None when it has none."""
    from ds4c.tokenizer import Tokenizer, has_tokenizer

    if not has_tokenizer(mf.metadata):
        return None
    tok = Tokenizer.from_metadata(mf.metadata, source=str(mf.path))
    return {"model": tok.model, "pre": tok.pre, "size": tok.vocab_size, "bos": tok.bos_id, "eos": tok.eos_id,
            "n_special": len(tok.specials), "chat_template": tok.chat_template is not None}


# ------------------------------------------------------------------------------------------------------
def _parse_ids(text: str) -> list[int]:
    parts = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not re.fullmatch(r"-?[0-9]+", t) for t in parts):
        raise click.BadParameter(f"expected comma-separated token ids like 1,2,3, found {text!r}",
                                 param_hint="--prompt-ids")
    return [int(t) for t in parts]


#: The prompt of ``ds4c generate`` when no prompt option is given: this text on a model with a tokenizer, these
#: ids on a file without one.
DEFAULT_PROMPT, DEFAULT_PROMPT_IDS = "The quick brown fox", "0,1,2,3"


def _read_prompt_file(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise Ds4cError(f"--prompt-file {path}: no such file")
    if not p.is_file():
        raise Ds4cError(f"--prompt-file {path}: expected a text file, found a directory or special file")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise Ds4cError(f"--prompt-file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def _timings_line(load_s: float, res, n_prompt: int) -> str:
    tps, ptps = res.decode_tokens_per_s, res.prefill_tokens_per_s
    dec = f"{tps:.2f} tokens/s" if tps is not None else "n/a (fewer than 2 new tokens)"
    pre = f"prefill {ptps:.1f} tokens/s; " if ptps is not None else ""
    spec = getattr(res, "speculative", None) or {}
    prep = f", drafter prepare {spec['prepare_s']:.2f} s" if spec.get("prepare_s") else ""
    plan = getattr(res, "prefill_plan", None) or {}
    how = ""
    if plan.get("chunks"):
        how = " (chunks " + "+".join(str(c) if c == k else f"{c}[{k}]" for c, k in plan["chunks"]) \
            + (f", {plan['verify_tokens']} as verify steps" if plan.get("verify_tokens") else "") + ")"
    return (f"load {load_s:.2f} s{prep}, prefill {n_prompt} tokens{how} in {res.prefill_s:.3f} s, decode {dec} "
            f"({pre}{len(res.tokens)} new token{'' if len(res.tokens) == 1 else 's'}, stop: {res.stop_reason})")


#: Seconds of prefill before ``ds4c generate`` shows its progress bar (a short prompt shows none).
PREFILL_BAR_DELAY_S = 2.0


def _prefill_progress(n_prompt: int):
    """The ``on_prefill`` of ``ds4c generate``: a bar of the prompt's tokens (rate, ETA) on stderr once the prefill
    has run :data:`PREFILL_BAR_DELAY_S` seconds (plain lines when stderr is not a terminal), closed with the
    prefill."""
    from ds4c.progress import progress_bar

    bar = progress_bar(n_prompt, "prefill", "token", delay=PREFILL_BAR_DELAY_S)

    def seen(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return seen


@main.command("generate")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--prompt", default=None, metavar="TEXT", help="Prompt text (tokenized with bos). Default: "
              f"{DEFAULT_PROMPT!r} (or ids {DEFAULT_PROMPT_IDS} on a file without tokenizer).")
@click.option("--prompt-file", default=None, metavar="FILE", help="Read the prompt text from this UTF-8 file.")
@click.option("--prompt-ids", default=None, metavar="IDS", help="Comma-separated prompt token ids (prints ids).")
@click.option("--chat", "chat", default=None, metavar="MESSAGE",
              help="A user message, rendered with the file's tokenizer.chat_template (generation prompt added).")
@click.option("--system", "system", default=None, metavar="TEXT", help="With --chat: a system message first.")
@click.option("--think/--no-think", "think", default=None,
              help="With --chat: the template's thinking switch (default: the template's own).")
@click.option("--reasoning-effort", default=None, metavar="LEVEL",
              help="With --chat: passed to the template as reasoning_effort (DeepSeek-V4: high, max; its template "
                   "uses it with --think only: an effort that changes nothing in the prompt is an error).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=16, show_default=True)
@click.option("--max-ctx", type=click.IntRange(min=1), default=None,
              help="Positions the sequence may hold; on cuda every graph up to it is compiled and captured before "
                   "the prompt runs (default: prompt + --max-new-tokens; with --artifact: the artifact's).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0, max=1e6), default=0.0, show_default=True,
              help="0 = greedy; else seeded sampling (spec P12).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample from the k most likely (0 = off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass in (0, 1] (1 = off).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True, help="Sampling seed.")
@click.option("--stop", "stops", multiple=True, help="Stop when the text contains this string (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the eos token.")
@click.option("--threads", type=int, default=None, help="CPU threads of the reference (default: torch's).")
@click.option("--no-quant-emulation", is_flag=True,
              help="Turn off activation FP8, KV FP8 and indexer FP4 emulation (for comparing with ports).")
@click.option("--dataflow", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Reference engine: activations and KV rounded to bf16 between operations (the spec), or kept "
                   "fp32 as llama.cpp does (token-exact comparisons, docs/interop.md).")
@click.option("--engine", type=click.Choice(["auto", "compiled", "reference"]), default="auto", show_default=True,
              help="auto: the compiled step (CUDA graphs) on cuda, the reference on cpu.")
@click.option("--artifact", type=click.Path(file_okay=False), default=None,
              help="Compiled engine: take the kernels from this `ds4c compile` artifact (nothing is compiled).")
@click.option("--draft", default=None, metavar="DRAFTER",
              help="Speculative decoding: oracle:ALPHA drafts the target's own greedy continuation with each "
                   "token wrong with probability 1-ALPHA (a benchmark of the loop); oracle:ALPHA:SEP adds an "
                   "emulated confidence head (logits N(+-SEP/2, 1) for right/wrong drafts; 0 = useless); "
                   "dspark:PATH or PATH.gguf a DSpark drafter file (dspark:synthetic:PRESET one made on demand); mtp "
                   "the model file's own MTP (nextn) block, mtp:PATH an MTP file (convert --mtp, make-model --drafter "
                   "mtp). Both run on both engines (compiled: the step records the DSpark taps / the MTP "
                   "block's final HC state).")
@click.option("--spec-width", default="5", show_default=True, metavar="1..5|auto",
              help="With --draft: verify rows per step (the last token and up to 4 drafts), or auto: per step from "
                   "the acceptance so far and each width's measured step cost; with a drafter's confidence head "
                   "(greedy), the most drafts are proposed and the verified count picked from their calibrated "
                   "confidences.")
@click.option("--prefill", "prefill", default=None, metavar="C,C,...",
              help="Compiled engine: ingest the prompt with prefill chunk graphs of these row counts (ints in "
                   "16..4096, e.g. 256,2048; chunks longer than the context are not built). Each step takes the "
                   "smallest chunk the tokens left fill at least half of (padded), else the largest they fill; "
                   "a tail under 16 tokens goes as verify steps. Not with a split, nor with --draft from an "
                   "--artifact; with --artifact, chunks it was compiled with: `ds4c compile --prefill`; 'none' "
                   "(or ''): verify steps of 5 rows. The timings line and --json's prefill_plan say which "
                   "chunks ran. Default: with "
                   "--artifact, the artifact's chunk graphs; with --draft, none; else 256,2048 (those that fit "
                   "--max-ctx and the memory plan; docs/prefill.md).")
@_split_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record (prompt, tokens, text, timings).")
def generate_cmd(file: str | None, prompt: str | None, prompt_file: str | None, prompt_ids: str | None,
                 chat: str | None, system: str | None, think: bool | None, reasoning_effort: str | None,
                 max_new_tokens: int, max_ctx: int | None, device: str, temperature: float, top_k: int, top_p: float,
                 seed: int,
                 stops: tuple[str, ...], ignore_eos: bool, threads: int | None, no_quant_emulation: bool,
                 dataflow: str, engine: str, artifact: str | None, draft: str | None, spec_width: str,
                 prefill: str | None, devices: str | None, layer_split: str | None, as_json: bool) -> None:
    """Generate text (greedy by default, streamed as tokens arrive; stops at eos): with the compiled step on
    cuda, the PyTorch reference on cpu. With --prompt-ids the prompt and the output are printed as ids."""
    import time

    from ds4c.api import Model
    from ds4c.engine import resolve_engine
    from ds4c.sources import open_model
    from ds4c.tokenizer import has_tokenizer

    given = [n for n, v in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-ids", prompt_ids),
                            ("--chat", chat)) if v is not None]
    if len(given) > 1:
        raise Ds4cError(f"give one of --prompt, --prompt-file, --prompt-ids, --chat; found {' and '.join(given)}")
    if chat is None and (system is not None or think is not None or reasoning_effort is not None):
        raise Ds4cError("--system, --think/--no-think and --reasoning-effort go with --chat MESSAGE")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        ([{"role": "user", "content": chat}] if chat is not None else [])
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    if not math.isfinite(temperature):
        raise click.BadParameter(f"expected a finite number >= 0, found {temperature}", param_hint="--temperature")
    if top_k < 0:
        raise Ds4cError(f"--top-k must be >= 0 (0 = off), found {top_k}")
    if not (0 < top_p <= 1):
        raise Ds4cError(f"--top-p must be in (0, 1] (1 = off), found {top_p}")
    if threads is not None and threads < 1:
        raise Ds4cError(f"--threads must be >= 1, found {threads}")
    if any(not s for s in stops):
        raise Ds4cError("--stop: expected a non-empty string")
    text = _read_prompt_file(prompt_file) if prompt_file is not None else prompt
    device = _device_of(device, devices)
    if prefill is not None:  # a bad value is named before the device is (a machine without a GPU says so too)
        from ds4c.buckets import check_prefill_chunks

        try:
            check_prefill_chunks(prefill)
        except StepError as e:
            raise Ds4cError(f"--prefill: {e}") from None
    resolve_engine(device, engine, dataflow)  # device / engine / dataflow errors before a model is opened
    t0 = time.perf_counter()
    mf = open_model(_model_path(file))
    limit = mf.config.max_position
    if ids is None and text is None and not messages:
        if has_tokenizer(mf.metadata):
            text = DEFAULT_PROMPT
        else:
            ids = _parse_ids(DEFAULT_PROMPT_IDS)
    if ids is not None:
        if len(ids) + max_new_tokens > limit:
            raise Ds4cError(f"{len(ids)} prompt ids + --max-new-tokens {max_new_tokens} exceed the model's context "
                            f"length {limit}")
        need = len(ids) + max_new_tokens
    else:
        if not has_tokenizer(mf.metadata):
            raise Ds4cError(f"{mf.path}: the file has no tokenizer (no tokenizer.ggml.* keys; written by ds4c before "
                            f"0.2?): give the prompt as --prompt-ids, or write the model again with ds4c make-model")
        if 1 + max_new_tokens > limit:
            raise Ds4cError(f"the prompt (at least 1 token) + --max-new-tokens {max_new_tokens} exceed the model's "
                            f"context length {limit}")
        if messages:  # rendered now, before the (possibly long) engine start: the chat rules fail first
            from ds4c.chat import render_chat
            from ds4c.tokenizer import Tokenizer

            text = render_chat(Tokenizer.from_metadata(mf.metadata, source=str(mf.path)), messages, thinking=think,
                               reasoning_effort=reasoning_effort, source=str(mf.path))
        # a token is >= 1 byte, + bos (the prompt is checked against max_ctx once tokenized, below)
        need = min(limit, len(text.encode("utf-8")) + 1 + max_new_tokens)
    drafter = None
    record_hc = False
    if draft is not None:  # checked before the (possibly long) engine start
        from ds4c.drafters.factory import make_drafter

        drafter = make_drafter(draft, mf.config.vocab_size, seed, config=mf.config, target_file=mf)
        taps = tuple(getattr(getattr(drafter, "file", None), "taps", None) or ())
        split = devices is not None or layer_split is not None
        compiled = resolve_engine(device, engine, dataflow) != "reference"
        from ds4c.drafters.mtp import MTPDrafter

        is_mtp = isinstance(drafter, MTPDrafter)
        record_hc = is_mtp and compiled  # the compiled step records X_main (spec 7.5)
        if is_mtp and split and not compiled:
            raise Ds4cError(f"--draft {draft}: the MTP drafter reads the target's final HC state, which the reference "
                            f"engine records unsplit only (no --devices / --layer-split; the compiled engine records "
                            f"it on a split too)")
        if taps and split:
            raise Ds4cError(f"--draft {draft}: the DSpark drafter runs on an unsplit target (no --devices / "
                            f"--layer-split)")
        if taps and compiled and artifact:
            raise Ds4cError(f"--draft {draft}: the compiled DSpark drafter is not served from an artifact yet; "
                            f"run without --artifact (the step then compiles with the drafter's taps)")
    spec_width = _spec_width(spec_width)
    chunks = _prefill_chunks(prefill, device, engine, dataflow, artifact, draft)
    if drafter is None and click.get_current_context().get_parameter_source("spec_width") \
            is not click.core.ParameterSource.DEFAULT:
        click.echo("ds4c: note: --spec-width sets the verify rows of speculative decoding; without --draft every "
                   "step is a plain decode", err=True)
    if drafter is not None:
        from ds4c.speculative import no_speculation

        why = no_speculation(spec_width)
        if why:
            click.echo(f"ds4c: note: {why}", err=True)
    if max_ctx is not None:
        if max_ctx > limit:
            raise Ds4cError(f"--max-ctx {max_ctx} exceeds the model's context length {limit}")
        if ids is not None and max_ctx < need:
            raise Ds4cError(f"--max-ctx {max_ctx} is below the {len(ids)} prompt ids + --max-new-tokens "
                            f"{max_new_tokens} = {need} positions")
        need = max_ctx
    model = Model(mf, device=device, artifact=artifact, max_ctx=max_ctx if artifact else need, engine=engine,
                  quant_emulation=not no_quant_emulation, threads=threads, dataflow=dataflow, devices=devices,
                  layer_split=layer_split, taps=taps if drafter is not None and compiled else (),
                  record_hc=record_hc, prefill_chunks=chunks)
    load_s = time.perf_counter() - t0
    _echo_prepare(getattr(model.stepper, "prepare_stats", None))
    plan = getattr(model.stepper, "plan", None)
    if plan is not None and not as_json:
        click.echo(f"layer split: {plan.describe()}", err=True)
    prompt_arg = ids if ids is not None else text
    ids = model.prompt_ids(prompt_arg)
    if len(ids) + max_new_tokens > limit:
        raise Ds4cError(f"the prompt's {len(ids)} tokens + --max-new-tokens {max_new_tokens} exceed the model's "
                        f"context length {limit}")
    if len(ids) + max_new_tokens > model.max_ctx:
        whose = f"the artifact's max_ctx {model.max_ctx}" if artifact else f"--max-ctx {model.max_ctx}"
        raise Ds4cError(f"{len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} exceed {whose}")
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
              stop=list(stops) or None, ignore_eos=ignore_eos, draft=drafter, spec_width=spec_width,
              on_prefill=_prefill_progress(len(ids)))
    text_mode = prompt_ids is None and model.tokenizer is not None
    if as_json or not text_mode:
        try:
            c, interrupted = model.generate(ids, **kw), False
        except GenerationInterrupted as e:  # Ctrl-C: the record / ids of what was made so far, then exit 130
            c, interrupted = e.completion, True
        res = c.result
        if as_json:
            rec = {"model": str(mf.path), "device": device, "engine": model.engine,
                   "shards": None if plan is None else plan.as_dict(), "temperature": temperature,
                   "top_k": top_k, "top_p": top_p, "seed": seed, "quant_emulation": not no_quant_emulation,
                   "dataflow": dataflow, "load_s": load_s, **res.as_dict(), "text": c.text}
            click.echo(json.dumps(rec))
        else:
            click.echo(f"prompt: {ids}")
            click.echo(f"tokens: {res.tokens}")
            if c.text is not None:
                click.echo(f"text: {json.dumps(c.text, ensure_ascii=False)}")
            click.echo(_timings_line(load_s, res, len(ids)), err=True)  # stderr, as in text mode
        if interrupted:
            sys.exit(EXIT_INTERRUPTED)
        return
    s = model.generate(ids, stream=True, **kw)
    try:
        for piece in s:
            click.echo(piece, nl=False)
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C: end the text, say how far it got (stop: interrupted)
        c = s.close(interrupted=True)
        click.echo("")
        click.echo(_timings_line(load_s, c.result, len(ids)), err=True)
        sys.exit(EXIT_INTERRUPTED)
    click.echo("")
    click.echo(_timings_line(load_s, s.completion.result, len(ids)), err=True)


# ------------------------------------------------------------------------------------------------------
@main.command("serve")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 exposes the server beyond this machine).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: a free port.")
@click.option("--model-name", default=None, help="The model id clients name (default: the file's name without .gguf).")
@click.option("--api-key", default=None, envvar="DS4C_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every route but /health.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="Sequences run at once (default: what the engine runs; today's engine runs 1, the rest queue).")
@click.option("--max-queue", type=click.IntRange(min=0), default=256, show_default=True,
              help="Requests that may wait for a sequence; one more gets 429.")
@click.option("--queue-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds a request may wait in the queue before 429.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds from arrival to the end of a request (then it is stopped: 408).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM / Ctrl-C: seconds to let requests in flight finish.")
@click.option("--stream-buffer", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Text pieces buffered per request for a client that is slow to read; one more cancels it.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=8 << 20, show_default=True,
              help="Larger request bodies get 413.")
@click.option("--max-ctx", type=click.IntRange(min=1), default=None,
              help="Positions a sequence may hold (prompt + reply). Default: the artifact's, else 4096.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--engine", type=click.Choice(["auto", "compiled", "reference"]), default="auto", show_default=True,
              help="auto: the compiled step (CUDA graphs) on cuda, the reference on cpu.")
@click.option("--artifact", type=click.Path(file_okay=False), default=None,
              help="Compiled engine: take the kernels from this `ds4c compile` artifact (nothing is compiled).")
@click.option("--draft", default=None, metavar="DRAFTER",
              help="Speculative decoding for every request (the spellings of `ds4c generate --draft`).")
@click.option("--spec-width", default="5", show_default=True, metavar="1..5|auto", help="With --draft: verify rows.")
@click.option("--prefill", "prefill", default=None, metavar="C,C,...",
              help="Compiled engine: prefill chunk graphs (as `ds4c generate --prefill`).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads of the reference (1 is fastest on a machine shared with other work).")
@click.option("--dataflow", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Reference engine activations (as `ds4c generate --dataflow`).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@_split_options
def serve_cmd(file: str | None, host: str, port: int, model_name: str | None, api_key: str | None,
              max_concurrency: int | None, max_queue: int, queue_timeout: float, request_timeout: float,
              drain_timeout: float, stream_buffer: int, max_body_bytes: int, max_ctx: int | None, device: str,
              engine: str, artifact: str | None, draft: str | None, spec_width: str, prefill: str | None,
              threads: int | None, dataflow: str, log_level: str, devices: str | None,
              layer_split: str | None) -> None:
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics; docs/serving.md). Runs until SIGTERM or Ctrl-C, then lets the requests in flight finish."""
    from ds4c.server import serve  # start-up speed: FastAPI and the model stack load only when the command runs

    device = _device_of(device, devices)
    serve(_model_path(file), host=host, port=port, max_concurrency=max_concurrency, api_key=api_key,
          model_name=model_name, device=device, engine=engine, artifact=artifact, max_ctx=max_ctx, threads=threads,
          dataflow=dataflow, devices=devices, layer_split=layer_split,
          prefill_chunks=_prefill_chunks(prefill, device, engine, dataflow, artifact, draft), draft=draft,
          spec_width=_spec_width(spec_width), max_queue=max_queue, queue_timeout_s=queue_timeout,
          request_timeout_s=request_timeout, stream_buffer=stream_buffer, max_body_bytes=max_body_bytes,
          drain_timeout_s=drain_timeout, log_level=log_level)


# ------------------------------------------------------------------------------------------------------
@main.command("inspect-ir")
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
def inspect_ir_cmd(file: str | None, preset_name: str | None, width: int, prefill: int | None, max_ctx: int,
                   context: int | None, pipeline: str, after: str | None, print_all: bool, layers: str | None,
                   dot: str | None, taps: str | None, record_hc: bool) -> None:
    """Print the step IR (or a prefill chunk's, --prefill C) after the chosen passes and a per-layer
    kernel-plan summary."""
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
        mf = open_model(_model_path(file))
        cfg = mf.config
        types = {name: mf.ggml_type(name) for name in mf.specs}
    types = plan_weight_types(cfg, types)
    if prefill is not None and width != 1:
        raise click.UsageError("give --width (a decode / verify step) or --prefill (a prefill chunk), not both")
    if prefill is not None and prefill > max_ctx:
        raise click.BadParameter(f"a prefill chunk of {prefill} rows is longer than the context ({max_ctx})",
                                 param_hint="--prefill")
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
    tap_layers = _compile_taps(cfg, taps, None)
    g0 = build_step(cfg, prefill, cap, prefill=True, taps=tap_layers, record_hc=record_hc) if prefill is not None \
        else build_step(cfg, width, cap, taps=tap_layers, record_hc=record_hc)
    want = "all" if print_all else ([after] if after else [])
    res = run_pipeline(g0, names, context=ctx, print_after=want)
    only = set(_parse_ints(layers, "--layers")) if layers else None
    if only and any(not -1 <= i < cfg.n_layers for i in only):
        raise click.BadParameter(f"layers must be in -1..{cfg.n_layers - 1} (-1 = embedding/head), found "
                                 f"{sorted(only)}", param_hint="--layers")
    if print_all or after:
        for name, snap in res.snapshots.items():
            click.echo(f"// ---- IR after {name}")
            click.echo(print_graph(snap, only))
    if dot:
        Path(dot).write_text(to_dot(res.graph))
        click.echo(f"wrote {dot}", err=True)
    what = f"prefill chunk of {prefill} rows" if prefill is not None else f"width {width}"
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


# ------------------------------------------------------------------------------------------------------
# literal so that `ds4c --help` does not import torch-mlir; tests check them against ds4c.export
MLIR_DIALECTS = ("torch", "linalg", "stablehlo", "tosa")
MLIR_WEIGHTS = ("inline", "external", "none")
MLIR_AFTER = ("pad_compressed_kv", "fuse_hc", "fuse_projections", "fuse_elementwise", "partition", "plan_memory")


def _layer_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*", text)
    if not m:
        raise click.BadParameter(f"expected a layer range A:B (layers A..B-1), found {text!r}", param_hint="--layers")
    return int(m.group(1)), int(m.group(2))


@main.command("export-mlir")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--width", type=click.IntRange(1, 5), default=1, show_default=True, help="Step width q (1 = decode).")
@click.option("--prefill", "prefill", type=click.IntRange(1, MAX_PREFILL_ROWS), default=None, metavar="C",
              help="Export the prefill chunk graph of C rows instead of a step (input n_valid: rows past it are "
                   "padding).")
@click.option("--ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Positions the state holds (rounded up to a multiple of the compress ratios; spans padded to it).")
@click.option("--layers", "layers", default=None, metavar="A:B",
              help="Export the layer-split shard of layers A..B-1 (hc_in / hc_out where it does not hold the "
                   "embedding / head).")
@click.option("--dialect", type=click.Choice(MLIR_DIALECTS), default="linalg", show_default=True,
              help="torch (torch-mlir's backend contract), linalg (linalg-on-tensors), stablehlo or tosa.")
@click.option("--weights", "weights", type=click.Choice(MLIR_WEIGHTS), default="external", show_default=True,
              help="inline: constants of the module (small models only); external: function arguments, their "
                   "values in OUTPUT with the suffix .safetensors; none: arguments, nothing written.")
@click.option("--after", type=click.Choice(MLIR_AFTER), default="pad_compressed_kv", show_default=True,
              help="The last pass run on the step graph (fused ops export as their bodies).")
@click.option("--dataflow", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="bf16: the spec's activations and state; fp32: nothing rounded to bf16.")
@click.option("--no-quant-emulation", is_flag=True,
              help="Leave out the activation FP8, KV FP8 and indexer FP4 fake quantization.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Output MLIR file (text).")
def export_mlir_cmd(file: str | None, width: int, prefill: int | None, ctx: int, layers: str | None, dialect: str,
                    weights: str, after: str, dataflow: str, no_quant_emulation: bool, output: str) -> None:
    """Export the step graph (or a prefill chunk's) as MLIR through torch-mlir (docs/mlir.md): the function
    @step of the graph's inputs and state buffers (then the weights) returning the updated state and the logits.
    Needs the ds4c[mlir] extra (torch-mlir, ml_dtypes)."""
    from ds4c.export import export_mlir  # here, not at the top: start-up speed (torch, torch-mlir)

    if prefill is not None and width != 1:
        raise click.UsageError("give --width (a decode / verify step) or --prefill (a prefill chunk), not both")
    e = export_mlir(_model_path(file), output, width=width, prefill=prefill, ctx=ctx, layers=_layer_range(layers),
                    dialect=dialect, weights=weights, after=after, dataflow=dataflow,
                    quant_emulation=not no_quant_emulation)
    d = e.description
    what = f"prefill chunk of {d['width']} rows" if d["prefill"] else f"width {d['width']}"
    click.echo(f"wrote {e.path} ({d['config']}, {what}, ctx {d['ctx']}, layers {d['layers']}, {e.dialect}, "
               f"{len(e.inputs)} arguments, {len(e.outputs)} results)", err=True)
    if e.weights_path is not None:
        click.echo(f"wrote {e.weights_path} ({len(e.weights)} weights, {e.weight_bytes / 1e6:.1f} MB)", err=True)


# ------------------------------------------------------------------------------------------------------
def _check_writable_json(json_out: str) -> None:
    """--json: a file the record can be written to when the run ends (checked before it starts)."""
    from ds4c.tempfiles import check_writable

    if not json_out.strip():
        raise Ds4cError("--json: expected a file path, found ''")
    try:
        check_writable(json_out)
    except OSError as e:
        raise Ds4cError(f"--json {json_out}: cannot write a file there ({e.strerror or e})") from None


def write_json_atomic(path: str, rec: dict) -> None:
    """Write ``rec`` as indented JSON to ``path`` whole or not at all (ds4c.tempfiles.write_text_atomic)."""
    from ds4c.tempfiles import write_text_atomic

    try:
        write_text_atomic(path, json.dumps(rec, indent=1))
    except OSError as e:
        raise Ds4cError(f"--json {path}: cannot write the record ({e.strerror or e})") from None


def _parse_ints(text: str, hint: str) -> list[int]:
    parts = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not re.fullmatch(r"-?[0-9]+", t) for t in parts):
        raise click.BadParameter(f"expected comma-separated integers like 1,2,3, found {text!r}", param_hint=hint)
    return [int(t) for t in parts]


@main.command("compile")
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
def compile_cmd(file: str | None, preset_name: str | None, archs: str, widths: str, max_ctx: int,
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
    from ds4c.buckets import BucketSpec, check_prefill_chunks
    from ds4c.config import preset
    from ds4c.sources import open_model
    from ds4c.runtime.artifact import build_artifact
    from ds4c.runtime.artifact_manifest import load_manifest
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.targets import parse_targets

    if file and preset_name:
        raise click.UsageError("give a model file or --preset, not both")
    if not output.strip():
        raise Ds4cError("-o: expected an artifact folder path, found ''")
    targets = parse_targets(archs)
    ws = _parse_ints(widths, "--widths")
    cs = _parse_ints(contexts, "--contexts") if contexts is not None else None
    chunks: tuple[int, ...] = ()
    if prefill is not None:  # checked before the model is opened or anything lowered
        try:
            chunks = check_prefill_chunks(prefill)
        except StepError as e:
            raise Ds4cError(f"--prefill: {e}") from None
        if not chunks:
            raise Ds4cError(f"--prefill: expected chunk sizes such as 256,2048, found {prefill!r}")
        long = [n for n in chunks if n > max_ctx]
        if long:
            raise Ds4cError(f"--prefill {prefill}: a chunk of {long[0]} rows is longer than --max-ctx {max_ctx} (its "
                            f"rows never fit the context); give chunks <= {max_ctx} or a larger --max-ctx")
        for what, on in (("--layer-split", layer_split is not None), ("--taps", taps is not None),
                         ("--draft", draft is not None)):
            if on:
                raise Ds4cError(f"--prefill {prefill} with {what}: prefill chunk graphs are compiled for the unsplit "
                                f"step without taps or the final HC state (their chunk kernels are not written for "
                                f"the others); drop one of them")
    if preset_name:
        cfg, types = preset(preset_name), None
    else:
        mf = open_model(_model_path(file))
        cfg, types = mf.config, {name: mf.ggml_type(name) for name in mf.specs}
    buckets = BucketSpec.build(cfg, ws, max_ctx, cs)
    split = None
    if layer_split is not None:
        from ds4c.shard_plan import parse_plan

        n = len(layer_split.split(","))
        split = parse_plan(["cuda"] * n, layer_split, cfg.n_layers).layers
    record_hc = draft is not None and (draft == "mtp" or draft.startswith("mtp:"))
    tap_layers = _compile_taps(cfg, taps, None if record_hc else draft)
    cache = KernelCache()
    out = build_artifact(cfg, targets, buckets, output, cache, jobs=jobs, weight_types=types, layer_split=split,
                         taps=tap_layers, record_hc=record_hc, prefill_chunks=chunks)
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
    if tap_layers:
        click.echo(f"taps:      DSpark taps of layers {','.join(map(str, tap_layers))}")
    if record_hc:
        click.echo("final HC:  every graph records the final HC state (spec 7.5; the MTP drafter's input)")
    click.echo(f"kernels:   {b['plan_kernels']} plan kernels, {b['launches']} launches")
    click.echo(f"binaries:  {b['unique_binaries']} unique: compiled {b['compiled']}, cached {b['cached']}")
    click.echo(f"seconds:   {b['seconds']:.1f}")


def _compile_taps(cfg, taps: str | None, draft: str | None) -> tuple[int, ...]:
    """The tap layers of ``compile --taps`` / ``--draft`` (one of them, or neither: none), checked against ``cfg``."""
    from ds4c.ir.builder import check_taps

    if taps is not None and draft is not None:
        raise click.UsageError("give --taps or --draft (whose target layers are the taps), not both")
    if draft is not None:
        from ds4c.drafters.dspark_sources import open_dspark

        return tuple(open_dspark(Path(draft), cfg).taps)
    if taps is None:
        return ()
    layers = _parse_ints(taps, "--taps")
    if any(not 0 <= t < cfg.n_layers for t in layers) or len(set(layers)) != len(layers):
        raise click.BadParameter(f"expected distinct layer ids in 0..{cfg.n_layers - 1}, found {layers}",
                                 param_hint="--taps")
    return check_taps(cfg, layers)


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


@main.command("bench")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True,
              help="cuda: every column; cpu: the reference columns only.")
@click.option("--widths", default="1,2,3,4,5", show_default=True, help="Comma-separated verify widths (1..5).")
@click.option("--ctx", "contexts", default="4096", show_default=True,
              help="Comma-separated contexts: each step starts at ctx-5, so it ends inside the bucket ctx.")
@click.option("--repeats", type=click.IntRange(min=3), default=50, show_default=True,
              help="Graph replays timed per (width, context).")
@click.option("--ref-repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Reference steps timed per (width, context) and engine.")
@click.option("--compile-modes", default="reduce-overhead,default", show_default=True,
              help="torch.compile modes tried for the reference ('none': skip torch.compile).")
@click.option("--artifact", type=click.Path(file_okay=False), default=None,
              help="Use this artifact (default: compile one here with a cold cache and time it).")
@click.option("--transformers/--no-transformers", default=True, show_default=True,
              help="Time the transformers port when it is importable.")
@click.option("--llama-bench", "llama_bench", type=click.Path(dir_okay=False), default=None,
              help="llama.cpp's llama-bench: its tg rate at each --ctx on the same file, next to ours.")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="Time the reference columns (eager, torch.compile); --no-reference loads no second copy of "
                   "the weights (a model that fills the device, e.g. synthetic:flash:q3_k on one H200).")
@click.option("--generate/--no-generate", "end_to_end", default=True, show_default=True,
              help="After the step timings, run generate end to end at each --ctx (TTFT, the loop's tokens/s).")
@click.option("--prefill", "prefill", default=None, metavar="L,L,...",
              help="Instead of the step table: prefill prompts of these lengths (e.g. 4096,32768): tokens/s and "
                   "TTFT through the prefill chunk graphs and as verify steps, the compute roofline from the "
                   "card's measured GEMM rate, and with --llama-bench llama.cpp's pp at each length.")
@click.option("--prefill-chunks", default=",".join(map(str, (256, 2048))), show_default=True, metavar="C,C,...",
              help="With --prefill: the chunk graph sizes compiled.")
@click.option("--prefill-baseline/--no-prefill-baseline", default=True, show_default=True,
              help="With --prefill: also time the verify-step path once per length.")
@_split_options
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write the record here.")
def bench_cmd(file: str | None, device: str, widths: str, contexts: str, repeats: int, ref_repeats: int,
              compile_modes: str, artifact: str | None, transformers: bool, llama_bench: str | None,
              reference: bool, end_to_end: bool, prefill: str | None, prefill_chunks: str, prefill_baseline: bool,
              devices: str | None, layer_split: str | None, json_out: str | None) -> None:
    """Time one decode/verify step: compiled (CUDA graph replay) vs the reference in torch eager, torch.compile
    of the reference, the transformers port when importable, and the HBM roofline; ratios printed last.
    With --prefill: prompt ingestion instead (ds4c/prefill_bench.py)."""
    from ds4c.bench import format_report, run_bench
    from ds4c.sources import open_model

    ws = tuple(_parse_ints(widths, "--widths"))
    cs = tuple(_parse_ints(contexts, "--ctx"))
    if json_out is not None:  # fail before the (long) run, not after it
        _check_writable_json(json_out)
    modes = () if compile_modes.strip() == "none" else tuple(m.strip() for m in compile_modes.split(","))
    if llama_bench is not None:
        llama_bench = os.path.abspath(llama_bench)  # the path checked is the path run (not looked up on PATH)
    if llama_bench is not None and not (os.path.isfile(llama_bench) and os.access(llama_bench, os.X_OK)):
        raise Ds4cError(f"--llama-bench {llama_bench}: expected llama.cpp's llama-bench executable "
                        f"(built with llama.cpp, https://github.com/ggml-org/llama.cpp), found no executable file")
    chunks: tuple[int, ...] = ()
    src = click.get_current_context().get_parameter_source
    if prefill is None:
        given = [o for o, p in (("--prefill-chunks", "prefill_chunks"), ("--no-prefill-baseline", "prefill_baseline"))
                 if src(p) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise Ds4cError(f"{', '.join(given)}: applies only with --prefill LENGTHS")
    else:
        lengths = tuple(_parse_ints(prefill, "--prefill"))
        if not lengths or min(lengths) < 1 or len(set(lengths)) != len(lengths):
            what = "a duplicate in " if lengths and len(set(lengths)) != len(lengths) else ""
            raise Ds4cError(f"--prefill: expected distinct prompt lengths >= 1 (tokens), found {what}{prefill!r}")
        if devices or layer_split or artifact:
            raise Ds4cError("--prefill times the unsplit compiled step built here: drop --devices / --layer-split / "
                            "--artifact")
        try:
            from ds4c.buckets import check_prefill_chunks

            chunks = check_prefill_chunks(prefill_chunks)
        except StepError as e:
            raise Ds4cError(f"--prefill-chunks: {e}") from None
        if device != "cuda":
            chunks = ()  # the reference has no chunk graphs: only the verify column runs
            if not prefill_baseline:
                raise Ds4cError("--no-prefill-baseline on the cpu leaves nothing to measure (the chunk graphs need "
                                "--device cuda)")
    mf = open_model(_model_path(file))
    if llama_bench is not None and getattr(mf, "generates_on_device", False):
        raise Ds4cError(f"--llama-bench reads a GGUF file; {mf.path} has none (write it with ds4c make-model)")
    if prefill is not None:
        from ds4c.prefill_bench import format_prefill_report, run_prefill_bench

        prep = run_prefill_bench(mf, lengths, device, chunks, llama_bench, baseline=prefill_baseline,
                                 say=lambda m: click.echo(m, err=True))
        click.echo(format_prefill_report(prep))
        if json_out:
            write_json_atomic(json_out, prep.as_dict())
        return
    rep = run_bench(mf, _device_of(device, devices), ws, cs, repeats, ref_repeats, modes, artifact,
                    transformers=transformers, llama_bench=llama_bench, devices=devices, layer_split=layer_split,
                    reference=reference, end_to_end=end_to_end, say=lambda m: click.echo(m, err=True))
    click.echo(format_report(rep))
    if json_out:
        write_json_atomic(json_out, rep.as_dict())


@main.command("inspect")
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
def inspect_cmd(artifact: str, list_kernels: bool, kernel: str | None, show_source: bool, show_resources: bool,
                show_sass: bool, arch: str | None, graph: str | None, model: str | None) -> None:
    """Inspect an artifact folder built by `ds4c compile` (every load checks that manifest.json is unchanged)."""
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
        from ds4c.sources import open_model

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


# ------------------------------------------------------------------------------------------------------
@main.group("cache", cls=_Group)
def cache_group() -> None:
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


@cache_group.command("list")
def cache_list_cmd() -> None:
    """One line per cache entry: target, kernel name, hash, binary size, age; then the temporary folders of
    compiles (in progress, and the stale ones of killed compiles, which opening the cache removes)."""
    import time

    from ds4c.runtime.cache import KernelCache

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


@cache_group.command("show")
@click.argument("key")
def cache_show_cmd(key: str) -> None:
    """Show one entry (KEY: a hash prefix from `ds4c cache list`): its key inputs, resource use, files."""
    from ds4c.runtime.cache import KernelCache

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


@cache_group.command("clear")
def cache_clear_cmd() -> None:
    """Remove every cache entry (all ds4c versions)."""
    from ds4c.runtime.cache import KernelCache

    cache = KernelCache()
    n = cache.clear()
    click.echo(f"removed {n} cache entr{'y' if n == 1 else 'ies'} from {cache.root}")


if __name__ == "__main__":  # pragma: no cover
    main()
