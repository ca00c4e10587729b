"""Rendering, toolchains, the compile cache, artifacts and graph replay (``ds4c.runtime``). docs/codegen.md
describes them; nothing upstream imports this package."""
