"""IR passes (``ds4c.passes``): one module per pass, each a function Graph -> Graph whose docstring says
what it preserves. Populated by the step-IR work (issue 3); the reference and CLI do not depend on it."""
