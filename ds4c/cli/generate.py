"""``ds4c generate``: tokens through :class:`ds4c.Model` (the compiled step on cuda, the PyTorch reference on
cpu), streamed as text or printed as ids / one JSON record.

The options become a :class:`~ds4c.api.Model` and one :meth:`~ds4c.api.Model.generate` call; the rules of what
runs with what (sampling values, stop strings, prefill chunk graphs, what a drafter needs of its target) are the
API's (:func:`ds4c.generate.check_sampling`, :func:`ds4c.api.check_stops`,
:func:`ds4c.engine.check_prefill_request`, :func:`ds4c.engine.resolve_needs`), called here before the engine
starts so a bad request fails at once. What is left here: which prompt options go together, reading them, and the
context the run needs (the default ``--max-ctx``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import click

from ds4c.cli.shell import (EXIT_INTERRUPTED, device_of, model_path, prefill_chunks_option, spec_width_option,
                             split_options)
from ds4c.errors import Ds4cError, GenerationInterrupted

#: The prompt of ``ds4c generate`` when no prompt option is given: this text on a model with a tokenizer, these
#: ids on a file without one.
DEFAULT_PROMPT, DEFAULT_PROMPT_IDS = "The quick brown fox", "0,1,2,3"

#: Seconds of prefill before ``ds4c generate`` shows its progress bar (a short prompt shows none).
PREFILL_BAR_DELAY_S = 2.0


def _parse_ids(text: str) -> list[int]:
    parts = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not re.fullmatch(r"-?[0-9]+", t) for t in parts):
        raise click.BadParameter(f"expected comma-separated token ids like 1,2,3, found {text!r}",
                                 param_hint="--prompt-ids")
    return [int(t) for t in parts]


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


def timings_line(load_s: float, res, n_prompt: int) -> str:
    """The one stderr line after a generation: load, prefill (which chunks ran), decode rate, stop reason."""
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


def _prefill_progress(n_prompt: int):
    """The ``on_prefill`` of ``ds4c generate``: a bar of the prompt's tokens (rate, ETA) on stderr once the prefill
    has run :data:`PREFILL_BAR_DELAY_S` seconds (plain lines when stderr is not a terminal), closed with the
    prefill."""
    from ds4c.progress import progress_bar  # start-up speed

    bar = progress_bar(n_prompt, "prefill", "token", delay=PREFILL_BAR_DELAY_S)

    def seen(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return seen


@click.command("generate")
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
@split_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record (prompt, tokens, text, timings).")
def command(file: str | None, prompt: str | None, prompt_file: str | None, prompt_ids: str | None,
            chat: str | None, system: str | None, think: bool | None, reasoning_effort: str | None,
            max_new_tokens: int, max_ctx: int | None, device: str, temperature: float, top_k: int, top_p: float,
            seed: int, stops: tuple[str, ...], ignore_eos: bool, threads: int | None, no_quant_emulation: bool,
            dataflow: str, engine: str, artifact: str | None, draft: str | None, spec_width: str,
            prefill: str | None, devices: str | None, layer_split: str | None, as_json: bool) -> None:
    """Generate text (greedy by default, streamed as tokens arrive; stops at eos): with the compiled step on
    cuda, the PyTorch reference on cpu. With --prompt-ids the prompt and the output are printed as ids."""
    # start-up speed: the model stack (torch) loads only when the command runs
    from ds4c.api import Model, check_stops
    from ds4c.engine import check_prefill_request, resolve_engine, resolve_needs
    from ds4c.engine_protocol import drafter_needs
    from ds4c.generate import check_sampling
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
    check_sampling(temperature, top_k, top_p)  # the API's rules, before the (possibly long) engine start
    stop = check_stops(list(stops))
    text = _read_prompt_file(prompt_file) if prompt_file is not None else prompt
    device = device_of(device, devices)
    # a bad --prefill value is named before the device is (a machine without a GPU says so too)
    chunks = prefill_chunks_option(prefill, "--prefill") if prefill is not None else None
    resolve_engine(device, engine, dataflow)  # device / engine / dataflow errors before a model is opened
    t0 = time.perf_counter()
    mf = open_model(model_path(file))
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
            from ds4c.chat import render_chat  # start-up speed
            from ds4c.tokenizer import Tokenizer

            text = render_chat(Tokenizer.from_metadata(mf.metadata, source=str(mf.path)), messages, thinking=think,
                               reasoning_effort=reasoning_effort, source=str(mf.path))
        # a token is >= 1 byte, + bos (the prompt is checked against max_ctx once tokenized, below)
        need = min(limit, len(text.encode("utf-8", "surrogatepass")) + 1 + max_new_tokens)
    drafter, taps, record_hc = None, (), False
    if draft is not None:  # checked before the (possibly long) engine start
        from ds4c.drafters.factory import make_drafter  # start-up speed

        drafter = make_drafter(draft, mf.config.vocab_size, seed, config=mf.config, target_file=mf)
        taps, record_hc = resolve_needs(drafter_needs(drafter), resolve_engine(device, engine, dataflow),
                                        devices is not None or layer_split is not None, artifact, name=draft)
    spec_width = spec_width_option(spec_width)
    if chunks is None and draft is not None:
        chunks = ()  # --prefill's default with --draft: no chunk graphs (a drafter's are asked for explicitly)
    chunks = check_prefill_request(chunks, device, engine, dataflow, artifact, taps, record_hc)
    if drafter is None and click.get_current_context().get_parameter_source("spec_width") \
            is not click.core.ParameterSource.DEFAULT:
        click.echo("ds4c: note: --spec-width sets the verify rows of speculative decoding; without --draft every "
                   "step is a plain decode", err=True)
    if drafter is not None:
        from ds4c.speculative import no_speculation  # start-up speed

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
                  layer_split=layer_split, taps=taps, record_hc=record_hc, prefill_chunks=chunks)
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
              stop=stop or None, ignore_eos=ignore_eos, draft=drafter, spec_width=spec_width,
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
            click.echo(timings_line(load_s, res, len(ids)), err=True)  # stderr, as in text mode
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
        click.echo(timings_line(load_s, c.result, len(ids)), err=True)
        sys.exit(EXIT_INTERRUPTED)
    click.echo("")
    click.echo(timings_line(load_s, s.completion.result, len(ids)), err=True)
