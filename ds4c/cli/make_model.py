"""``ds4c make-model``: a deterministic synthetic model or drafter file (:func:`ds4c.synth.make_model`,
:func:`ds4c.drafters.dspark_synth.make_dspark`, :func:`ds4c.drafters.mtp_synth.make_mtp`)."""

from __future__ import annotations

import click

from ds4c.config import PRESETS

_KQ = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"]
#: ds4c.tensors.FORMATS' names, spelled here so the CLI starts without importing torch (tests check they agree)
FORMAT_NAMES = ["official", "bf16", "f32"] + _KQ + [f"{k}_all" for k in _KQ]


@click.command("make-model")
@click.option("--preset", "preset_name", type=click.Choice(list(PRESETS)), default="tiny",
              show_default=True, help="Model dimensions.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Random seed of the weights.")
@click.option("--formats", type=click.Choice(FORMAT_NAMES), default="official", show_default=True,
              help="official: Q8_0 for FP8 weights, MXFP4 experts, BF16/F32 elsewhere; bf16: all BF16/F32; f32: all "
                   "F32 (the same model, for exact comparisons with other engines, docs/interop.md); q2_k .. iq4_xs: "
                   "official with the routed experts in that llama.cpp type; q2_k_all .. iq4_xs_all: every FP8 and "
                   "FP4 weight in it, the shape of a llama-quantize K-quant mix (Q8_0 for rows not a multiple of "
                   "256).")
@click.option("--drafter", type=click.Choice(["dspark", "mtp"]), default=None,
              help="Write instead a synthetic drafter of the model this preset and seed make: dspark, the DSpark "
                   "drafter (spec section 7, llama.cpp's dflash layout; generate --draft FILE), or mtp, its MTP block "
                   "(spec 7.5, llama.cpp's convert --mtp layout; generate --draft mtp:FILE).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Output .gguf file.")
def command(preset_name: str, seed: int, formats: str, drafter: str | None, output: str) -> None:
    """Write a deterministic synthetic model (streams tensor by tensor; atomic)."""
    # start-up speed: the model stack (torch) loads only when the command runs
    from ds4c.config import preset
    from ds4c.progress import progress_bar
    from ds4c.quant import nbytes
    from ds4c.synth import make_model
    from ds4c.tensors import storage_types, tensor_specs

    cfg = preset(preset_name)
    if drafter == "dspark":
        from ds4c.drafters.dspark_synth import make_dspark  # start-up speed

        path = make_dspark(cfg, output, seed=seed, formats=formats)
        click.echo(f"wrote {path} ({path.stat().st_size / 1e9:.3f} GB, DSpark drafter of preset {preset_name} seed "
                   f"{seed}, formats {formats})")
        return
    if drafter == "mtp":
        from ds4c.drafters.mtp_synth import make_mtp  # start-up speed

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
