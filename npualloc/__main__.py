"""`python -m npualloc ...`: the same CLI as the `npualloc` console script."""
import sys

from .cli import main

sys.exit(main())
