"""The step path: the runner every route takes, the engine (layout, agreement), the bucket pipeline,
accumulation and join, and the local-optimizer interface."""
