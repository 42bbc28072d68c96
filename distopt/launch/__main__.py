"""``python -m distopt.launch -n N script.py ...``: see :func:`distopt.launch.cli.main`."""
import sys

from .cli import main

sys.exit(main())
