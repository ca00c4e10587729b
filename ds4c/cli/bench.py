"""``ds4c bench``: one decode/verify step timed against the references and the roofline
(:func:`ds4c.bench.run_bench`), or with ``--prefill`` prompt ingestion (:func:`ds4c.prefill_bench.run_prefill_bench`).
Both own their rules (widths, contexts, modes, ``--llama-bench``, lengths, what the cpu can time); here only the
options' syntax and which of them go together."""

from __future__ import annotations

import click

from ds4c.cli.shell import (LANES_POLICY_OPTIONS, check_writable_json, device_of, lanes_policy_options, model_path,
                            parse_ints, prefill_chunks_option, split_options, write_json)
from ds4c.errors import Ds4cError


@click.command("bench")
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
@click.option("--lanes", "lanes", default=None, metavar="L,L,...",
              help="Instead of the step table: L sequences at once through the continuous-batching engine at each L "
                   "(aggregate tokens/s, ITL, TTFT, their ratios to one sequence), a long prompt arriving beside "
                   "decoding sequences, and a second turn from the prefix cache vs cold (ds4c/lanes_bench.py; the "
                   "compiled engine on cuda, the reference on cpu; --lanes-engine picks).")
@click.option("--lanes-engine", type=click.Choice(["auto", "reference", "compiled"]), default="auto",
              show_default=True, help="With --lanes: the engine the batch runs on.")
@lanes_policy_options
@click.option("--new-tokens", type=click.IntRange(min=2), default=64, show_default=True,
              help="With --lanes: new tokens per request.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True,
              help="With --lanes: prompt length of the decoding requests.")
@click.option("--long-prompt", type=click.IntRange(min=32), default=4096, show_default=True,
              help="With --lanes: the prompt that arrives beside decoding sequences, and the first chat turn's.")
@split_options
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write the record here.")
def command(file: str | None, device: str, widths: str, contexts: str, repeats: int, ref_repeats: int,
            compile_modes: str, artifact: str | None, transformers: bool, llama_bench: str | None,
            reference: bool, end_to_end: bool, prefill: str | None, prefill_chunks: str, prefill_baseline: bool,
            lanes: str | None, lanes_engine: str, lanes_prefill_chunk: int | None, lanes_prefill_every: int,
            lanes_prefill_rows: int, new_tokens: int, prompt_len: int,
            long_prompt: int, devices: str | None, layer_split: str | None, json_out: str | None) -> None:
    """Time one decode/verify step: compiled (CUDA graph replay) vs the reference in torch eager, torch.compile
    of the reference, the transformers port when importable, and the HBM roofline; ratios printed last.
    With --prefill: prompt ingestion instead (ds4c/prefill_bench.py); with --lanes: many sequences at once
    (ds4c/lanes_bench.py)."""
    # start-up speed: the model stack (torch) loads only when the command runs
    from ds4c.bench import format_report, run_bench
    from ds4c.sources import open_model
    from ds4c.prefill_bench import format_prefill_report, run_prefill_bench

    ws = tuple(parse_ints(widths, "--widths"))
    cs = tuple(parse_ints(contexts, "--ctx"))
    if json_out is not None:  # fail before the (long) run, not after it
        check_writable_json(json_out)
    modes = () if compile_modes.strip() == "none" else tuple(m.strip() for m in compile_modes.split(","))
    src = click.get_current_context().get_parameter_source
    if prefill is None:
        given = [o for o, p in (("--prefill-chunks", "prefill_chunks"), ("--no-prefill-baseline", "prefill_baseline"))
                 if src(p) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise Ds4cError(f"{', '.join(given)}: applies only with --prefill LENGTHS")
    else:
        lengths = tuple(parse_ints(prefill, "--prefill"))
        if devices or layer_split or artifact:
            raise Ds4cError("--prefill times the unsplit compiled step built here: drop --devices / --layer-split / "
                            "--artifact")
        chunks = prefill_chunks_option(prefill_chunks, "--prefill-chunks")
    lanes_only = [o for o, p in (("--new-tokens", "new_tokens"), ("--prompt-len", "prompt_len"),
                                 ("--long-prompt", "long_prompt"), ("--lanes-engine", "lanes_engine"),
                                 *LANES_POLICY_OPTIONS) if src(p) is not click.core.ParameterSource.DEFAULT]
    if lanes is None and lanes_only:
        raise Ds4cError(f"{', '.join(lanes_only)}: applies only with --lanes L,L,...")
    if lanes is not None and (prefill is not None or devices or layer_split or artifact):
        raise Ds4cError("--lanes runs the continuous-batching engine on one device: drop --prefill / --devices / "
                        "--layer-split / --artifact")
    mf = open_model(model_path(file))
    if lanes is not None:
        from ds4c.lanes_bench import format_lanes_report, run_lanes_bench

        lrep = run_lanes_bench(mf, device, tuple(parse_ints(lanes, "--lanes")), new_tokens, prompt_len, long_prompt,
                               engine=lanes_engine, prefill_chunk=lanes_prefill_chunk,
                               prefill_every=lanes_prefill_every, prefill_rows=lanes_prefill_rows,
                               say=lambda m: click.echo(m, err=True))
        click.echo(format_lanes_report(lrep))
        if json_out:
            write_json(json_out, lrep.as_dict())
        return
    if prefill is not None:
        prep = run_prefill_bench(mf, lengths, device, chunks, llama_bench, baseline=prefill_baseline,
                                 say=lambda m: click.echo(m, err=True))
        click.echo(format_prefill_report(prep))
        if json_out:
            write_json(json_out, prep.as_dict())
        return
    rep = run_bench(mf, device_of(device, devices), ws, cs, repeats, ref_repeats, modes, artifact,
                    transformers=transformers, llama_bench=llama_bench, devices=devices, layer_split=layer_split,
                    reference=reference, end_to_end=end_to_end, say=lambda m: click.echo(m, err=True))
    click.echo(format_report(rep))
    if json_out:
        write_json(json_out, rep.as_dict())
