"""Speculative-decoding drafters beyond the loop's oracle (docs/drafter.md).

* :mod:`ds4c.drafters.dspark_file`: the GGUF layout of a DeepSeek-V4-Flash-0731 DSpark drafter as llama.cpp's
  converter writes it (arch ``dflash``): tensor inventory, reader/validator, writer.
* :mod:`ds4c.drafters.dspark_synth`: deterministic synthetic drafter files.
* :mod:`ds4c.drafters.dspark_model`: the PyTorch reference of the drafter (docs/model.md section 7).
* :mod:`ds4c.drafters.dspark`: :class:`~ds4c.drafters.dspark.DSparkDrafter`, the drafter on the reference engine.
* :mod:`ds4c.drafters.mtp_file`: where an MTP (nextn) block comes from (the target file, or llama.cpp's
  ``convert --mtp`` export) and its checks against the target.
* :mod:`ds4c.drafters.mtp_synth`: deterministic synthetic MTP-only files in the converter's layout.
* :mod:`ds4c.drafters.mtp_model`: the PyTorch reference of the MTP block as a drafter (docs/model.md 7.5).
* :mod:`ds4c.drafters.mtp`: :class:`~ds4c.drafters.mtp.MTPDrafter`, the drafter on the reference engine.
"""
