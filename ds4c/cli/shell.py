"""What every ``ds4c`` command shares: the group that turns errors into one line (:class:`Group`), the options
and values several commands take (``--devices`` / ``--layer-split``, comma-separated ints, prefill chunk lists,
the model FILE argument, ``--json FILE``).

Imports of the model stack are inside the functions that need them (start-up speed: ``ds4c --help`` loads no
torch).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import click

from ds4c.errors import Ds4cError, StepError
from ds4c.tempfiles import check_writable, write_text_atomic
from ds4c.write_errors import FULL_ERRNOS, write_error_text

EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT (128 + 2)


class Group(click.Group):
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


def split_options(fn):
    """``--devices`` / ``--layer-split`` (a layer split, ``ds4c.shard_plan``) on a command."""
    fn = click.option("--layer-split", "layer_split", default=None, metavar="N,N,...",
                      help="Layers per shard, e.g. 22,21 (with --devices: one count per device; alone: every shard "
                           "on --device, a virtual split). Default with --devices: placed from the memory plan.")(fn)
    fn = click.option("--devices", "devices", default=None, metavar="DEV,DEV,...",
                      help="Run a layer split: one shard per device, e.g. cuda:0,cuda:1 (a device may repeat).")(fn)
    return fn


def lanes_policy_options(fn):
    """``--lanes-prefill-chunk`` / ``--lanes-prefill-every`` / ``--lanes-prefill-rows``: how the compiled step's
    batch ingests a prompt beside decoding sequences (:class:`~ds4c.batching.BatchConfig`)."""
    fn = click.option("--lanes-prefill-rows", type=click.IntRange(min=0, max=5), default=0, show_default=True,
                      help="With --lanes on the compiled engine: a prompt's rows as a lane of this many rows in the "
                           "decode step while sequences decode (0: prefill chunks beside them).")(fn)
    fn = click.option("--lanes-prefill-every", type=click.IntRange(min=1), default=1, show_default=True,
                      help="With --lanes on the compiled engine: a prefill piece every N steps while sequences "
                           "decode.")(fn)
    fn = click.option("--lanes-prefill-chunk", type=click.IntRange(min=1), default=None,
                      help="With --lanes on the compiled engine: the largest prefill chunk run beside decoding "
                           "sequences (default: the prefill policy's own chunks).")(fn)
    return fn


LANES_POLICY_OPTIONS = (("--lanes-prefill-chunk", "lanes_prefill_chunk"),
                        ("--lanes-prefill-every", "lanes_prefill_every"), ("--lanes-prefill-rows", "lanes_prefill_rows"))
"""The options :func:`lanes_policy_options` adds, with their parameter names."""


def given_on_command_line(name: str) -> bool:
    """Whether the current command's parameter ``name`` was given on the command line (not defaulted)."""
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def model_path(file: str | None) -> Path | str:
    """The model a command's FILE argument names (:func:`ds4c.default_model.model_path`: a path, a
    ``synthetic:...`` spec, or the built-in default model)."""
    from ds4c.default_model import model_path as resolve  # start-up speed: writing the default model needs torch

    return resolve(file)


def parse_ints(text: str, hint: str) -> list[int]:
    """Comma-separated integers of option ``hint`` (a usage error otherwise)."""
    parts = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not re.fullmatch(r"-?[0-9]+", t) for t in parts):
        raise click.BadParameter(f"expected comma-separated integers like 1,2,3, found {text!r}", param_hint=hint)
    return [int(t) for t in parts]


def prefill_chunks_option(text: str, option: str) -> tuple[int, ...]:
    """The prefill chunk sizes of ``option`` (``--prefill`` / ``--prefill-chunks``), read by the one parser
    :func:`ds4c.buckets.check_prefill_chunks` (``none`` or empty: ()); its error names the option."""
    from ds4c.buckets import check_prefill_chunks  # start-up speed

    try:
        return check_prefill_chunks(text)
    except StepError as e:
        raise Ds4cError(f"{option}: {e}") from None


def spec_width_option(text: str) -> int | str:
    """``--spec-width``: ``auto`` or an int 1..5, verify rows per speculative step (one-line error otherwise)."""
    t = str(text).strip()
    if t == "auto":
        return t
    if not re.fullmatch(r"[1-5]", t):
        raise Ds4cError(f"--spec-width: expected 1..5 (verify rows per step) or auto, found {text!r}")
    return int(t)


def tap_layers(cfg, taps: str | None, draft: str | None) -> tuple[int, ...]:
    """The tap layers of ``--taps`` / ``--draft`` (one of them, or neither: none), checked against ``cfg`` by
    :func:`ds4c.ir.builder.check_taps` (``compile`` and ``inspect-ir``)."""
    from ds4c.ir.builder import check_taps  # start-up speed

    if taps is not None and draft is not None:
        raise click.UsageError("give --taps or --draft (whose target layers are the taps), not both")
    if draft is not None:
        from ds4c.drafters.dspark_sources import open_dspark  # start-up speed

        return tuple(open_dspark(Path(draft), cfg).taps)
    if taps is None:
        return ()
    layers = parse_ints(taps, "--taps")
    try:
        return check_taps(cfg, layers)
    except StepError as e:
        raise Ds4cError(f"--taps {taps}: {e}") from None


def device_of(device: str, devices: str | None) -> str:
    """The device kind of a ``--devices`` list (all cpu or all cuda) when ``--device`` was not given, else
    ``--device``, which must then agree with the list (one-line errors; an empty or mixed list is named by
    the shard plan)."""
    if devices is None:
        return device
    from ds4c.shard_plan import ShardPlanError, normalize_device  # start-up speed

    kinds = {"cpu" if normalize_device(d) == "cpu" else "cuda" for d in devices.split(",") if d.strip()}
    if len(kinds) != 1:
        return device
    kind = kinds.pop()
    if given_on_command_line("device") and kind != device:
        raise ShardPlanError(f"--devices {devices}: expected {device} devices (--device {device}), found {kind} "
                             f"devices")
    return kind


def check_writable_json(json_out: str) -> None:
    """--json FILE: a file the record can be written to when the run ends (checked before it starts)."""
    if not json_out.strip():
        raise Ds4cError("--json: expected a file path, found ''")
    try:
        check_writable(json_out)
    except OSError as e:
        raise Ds4cError(f"--json {json_out}: cannot write a file there ({e.strerror or e})") from None


def write_json(path: str, rec: dict) -> None:
    """--json FILE: ``rec`` as indented JSON, whole or not at all (:func:`ds4c.tempfiles.write_text_atomic`)."""
    try:
        write_text_atomic(path, json.dumps(rec, indent=1))
    except OSError as e:
        raise Ds4cError(f"--json {path}: cannot write the record ({e.strerror or e})") from None
