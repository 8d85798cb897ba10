"""`python -m rtj_trainer.launcher [--rtj-...] <ft_launcher arguments>`: see `shim`."""

import sys

from .shim import main

if __name__ == "__main__":
    sys.exit(main())
