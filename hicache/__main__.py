"""`python -m hicache` runs the `hicache` command."""

import sys

from hicache.cli import main

sys.exit(main())
