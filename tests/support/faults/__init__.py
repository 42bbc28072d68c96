"""Scripts and worker functions for the fault-injection tests (tests/launch/test_reliability.py).

The ``*.py`` scripts here are run as plain programs under ``mpiexec`` (not
pytest), so an uncaught exception reaches ``sys.excepthook`` as in a real
training script. :mod:`tests.support.faults.shm_faults` holds the worker functions
that :func:`distopt.launch.spawn` runs (importable, so picklable).
"""
