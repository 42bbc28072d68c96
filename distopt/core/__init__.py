"""Core data model shared by every layer: array dispatch (NumPy/CuPy), fast casts, bucket layout, counters."""
