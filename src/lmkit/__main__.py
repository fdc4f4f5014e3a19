"""`python -m lmkit` runs the command line (also under torchrun)."""
import sys

from lmkit.cli import main

sys.exit(main())
