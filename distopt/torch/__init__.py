"""PyTorch integration: the optimizer adapter, the backward follower (DDP's hook route) and model sync.

Importing this package does not import torch; its modules do.
"""
