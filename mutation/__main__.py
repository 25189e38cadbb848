"""``python -m mutation``: the mutation run's command line (mutation/run.py)."""

import sys

from mutation.run import main

sys.exit(main())
