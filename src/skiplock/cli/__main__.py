"""``python -m skiplock.cli``: the same as the ``skiplock`` command."""

import sys

from ._main import main

sys.exit(main())
