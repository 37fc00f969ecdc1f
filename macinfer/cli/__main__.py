"""`python -m macinfer.cli ...`: the command line, as the `macinfer` entry point runs it."""

from macinfer.cli.main import main

main()
