"""`python -m ksi_cli`: the same as the `ksi` console script."""

from ksi_cli.main import main

main()
