"""`python -m diloco.cli`: the same command line as `diloco`."""

from diloco.cli import main

main()
