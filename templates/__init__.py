"""Jinja kernel templates (installed as ``ds4c/templates``): one folder per kernel family, vendor and wave
size as render parameters. docs/codegen.md "Templates and the vendor contract"."""
