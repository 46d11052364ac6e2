"""``python -m hotprefix.lint FILE...``: the same as ``hotprefix lint FILE...``."""

import sys

from hotprefix.lint.cli import main

sys.exit(main(sys.argv[1:]))
