"""`python -m lmkit` runs the command line (also under torchrun)."""
import sys

try:
    from lmkit.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is still importing: no traceback, the usual status
    print("lmkit: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
