"""The ``ds4c`` command line (click): a thin shell over the Python API.

One module per command, each defining ``command`` (a :class:`click.Command`): ``make_model`` (a synthetic GGUF),
``info`` (config, layer kinds, tensor bytes per type; ``--plan`` the memory plan, ``--env`` the settings),
``generate`` (tokens through :class:`ds4c.Model`), ``serve`` (OpenAI's API over HTTP, :mod:`ds4c.server`),
``inspect_ir``, ``export_mlir`` (the step as MLIR through torch-mlir), ``compile`` (an AOT artifact), ``inspect``
(an artifact: summary, kernels, source, resources, SASS/ISA), ``bench`` (one step: compiled vs torch eager vs
torch.compile vs the roofline; ``--prefill`` prompt ingestion), ``cache`` (``list|show|clear`` the compiled-kernel
cache). ``shell`` holds what they share (one-line errors, common options). ``info``, ``generate`` and ``serve``
with no file use the built-in default model (:mod:`ds4c.default_model`).

A command translates its options into calls of the Python API (:mod:`ds4c.api`, :mod:`ds4c.engine`,
:mod:`ds4c.bench`, ...) and prints what they return; the rules of what runs with what live in the API, so a
Python caller meets the same one-line errors. Only the options' own syntax (which options go together, text to
values) is checked here.

Adding a command: write ``ds4c/cli/NAME.py`` defining ``command`` (``@click.command("name")``) over an API
function, and add ``"NAME"`` to :data:`COMMANDS` below (one line). Its heavy imports go inside the command's
function, marked as being there for start-up speed (``ds4c --help`` imports every command module).
"""

from __future__ import annotations

import importlib

import click

from ds4c.version import __version__
from ds4c.cli.shell import Group

#: The command modules of ``ds4c``, in ``ds4c/cli/``: each defines ``command``.
COMMANDS = ("make_model", "info", "generate", "serve", "inspect_ir", "export_mlir", "compile", "bench", "inspect", "cache")


@click.group(cls=Group)
@click.version_option(__version__, prog_name="ds4c")
def main() -> None:
    """ds4c: compile and run DeepSeek-V4-Flash decode / verify steps."""


for _name in COMMANDS:
    main.add_command(importlib.import_module(f"ds4c.cli.{_name}").command)
