"""`python -m kvlab.serve [args]` is `kvlab serve [args]` (kvlab.entrypoints.cli)."""

import sys

from kvlab.entrypoints.cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
