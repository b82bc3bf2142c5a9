"""`python -m partrain.cli`."""

from partrain.cli import main

main()
