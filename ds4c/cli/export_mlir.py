"""``ds4c export-mlir``: a step graph (or a prefill chunk's, or a layer shard's) as MLIR through torch-mlir
(:func:`ds4c.export.export_mlir`, docs/mlir.md)."""

from __future__ import annotations

import re

import click

from ds4c.cli.shell import model_path
from ds4c.config import MAX_PREFILL_ROWS

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


@click.command("export-mlir")
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
def command(file: str | None, width: int, prefill: int | None, ctx: int, layers: str | None, dialect: str,
            weights: str, after: str, dataflow: str, no_quant_emulation: bool, output: str) -> None:
    """Export the step graph (or a prefill chunk's) as MLIR through torch-mlir (docs/mlir.md): the function
    @step of the graph's inputs and state buffers (then the weights) returning the updated state and the logits.
    Needs the ds4c[mlir] extra (torch-mlir, ml_dtypes)."""
    from ds4c.export import export_mlir  # start-up speed: torch, torch-mlir

    if prefill is not None and width != 1:
        raise click.UsageError("give --width (a decode / verify step) or --prefill (a prefill chunk), not both")
    e = export_mlir(model_path(file), output, width=width, prefill=prefill, ctx=ctx, layers=_layer_range(layers),
                    dialect=dialect, weights=weights, after=after, dataflow=dataflow,
                    quant_emulation=not no_quant_emulation)
    d = e.description
    what = f"prefill chunk of {d['width']} rows" if d["prefill"] else f"width {d['width']}"
    click.echo(f"wrote {e.path} ({d['config']}, {what}, ctx {d['ctx']}, layers {d['layers']}, {e.dialect}, "
               f"{len(e.inputs)} arguments, {len(e.outputs)} results)", err=True)
    if e.weights_path is not None:
        click.echo(f"wrote {e.weights_path} ({len(e.weights)} weights, {e.weight_bytes / 1e6:.1f} MB)", err=True)
