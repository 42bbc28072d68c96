"""Sharding in one place: everything that differs between ``zero=0``, 1, 2 and 3 (ZeRO).

* :mod:`~distopt.sharding.plan`: the stage and its checks, and the shard
  plan (which segment of every bucket each rank owns);
* :mod:`~distopt.sharding.sync`: the bucket sync the step engine holds
  (all-reduce or reduce-scatter per bucket, where a result lands, the
  finiteness vote, the update of array models);
* :mod:`~distopt.sharding.gather`: the parameters' all-gather after a
  sharded update;
* :mod:`~distopt.sharding.torch_step` and :mod:`~distopt.sharding.torch_state`:
  a torch optimizer's shard tensors, its gradient sink and its checkpoints;
* stage 3: :mod:`~distopt.sharding.torch_full` (its gradient sink),
  :mod:`~distopt.sharding.params` (the parameter segments, their gathers and
  frees) and :mod:`~distopt.sharding.param_hooks` (the model hooks that
  decide when).

Outside this package the stage is only passed through: the engine is
given a :class:`~distopt.sharding.sync.BucketSync`, the torch follower a
gradient sink, the checkpoint state a sharded state.
"""
