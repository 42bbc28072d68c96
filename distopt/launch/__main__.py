"""``python -m distopt.launch -n N script.py ...``: see :func:`distopt.launch.launcher.main`."""
import sys

from .launcher import main

sys.exit(main())
