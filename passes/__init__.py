"""IR passes (``ds4c.passes``): one module per pass, each a function Graph -> Graph whose docstring says
what it preserves; :mod:`passes.manager` runs named pipelines and prints the IR after any pass."""
