"""``python -m hotprefix.simulate``: the same as ``hotprefix simulate``."""

import sys

from hotprefix.simulate.cli import main

sys.exit(main())
