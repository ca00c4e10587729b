"""Speculative-decoding drafters (the loop is :mod:`ds4c.speculative`; what a drafter is and what it may need of the
engine: :mod:`ds4c.engine_protocol`).

* :mod:`ds4c.drafters.factory`: :func:`~ds4c.drafters.factory.make_drafter`, the drafter a ``--draft`` value names.
* :mod:`ds4c.drafters.oracle`: :class:`~ds4c.drafters.oracle.OracleDrafter`, the target's own greedy continuation at
  a chosen acceptance rate (a benchmark of the loop).
* :mod:`ds4c.drafters.dspark_file`: the GGUF layout of a DeepSeek-V4-Flash-0731 DSpark drafter as llama.cpp's
  converter writes it (arch ``dflash``): tensor inventory, reader/validator, writer.
* :mod:`ds4c.drafters.dspark_synth`: deterministic synthetic drafter files.
* :mod:`ds4c.drafters.dspark_model`: the PyTorch reference of the drafter (docs/model.md section 7).
* :mod:`ds4c.drafters.dspark`: :class:`~ds4c.drafters.dspark.DSparkDrafter`, the drafter (on the compiled step it
  runs :class:`~ds4c.runtime.dspark_exec.CompiledDSpark`).
* :mod:`ds4c.drafters.mtp_file`: where an MTP (nextn) block comes from (the target file, or llama.cpp's
  ``convert --mtp`` export) and its checks against the target.
* :mod:`ds4c.drafters.mtp_synth`: deterministic synthetic MTP-only files in the converter's layout.
* :mod:`ds4c.drafters.mtp_model`: the PyTorch reference of the MTP block as a drafter (docs/model.md 7.5).
* :mod:`ds4c.drafters.mtp`: :class:`~ds4c.drafters.mtp.MTPDrafter`, the drafter (on either engine).
"""
