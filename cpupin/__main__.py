"""``python -m cpupin``: the same as the ``cpupin`` command."""

import sys

from cpupin.cli import main

sys.exit(main())
