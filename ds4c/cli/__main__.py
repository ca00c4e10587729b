"""``python -m ds4c.cli ARGS``: the ``ds4c`` command line."""

from ds4c.cli import main

main()
