"""``python -m dartree.cli``."""

import sys

from . import main

sys.exit(main())
