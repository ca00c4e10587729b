"""Rendering, toolchains, the compile cache, artifacts and graph replay (``ds4c.runtime``). Populated by
the codegen/runtime work (issue 4); nothing upstream imports it."""
