"""``python -m services.cli``: the ``llmgw`` command line (see :mod:`services.cli.cli`)."""

from services.cli.cli import main

main()
