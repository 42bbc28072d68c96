"""The array half of sharding (ZeRO): what differs between ``zero=0``, 1, 2 and 3 in the step layer.

* :mod:`~distopt.sharding.plan`: the stage and its checks, and the shard
  plan (which segment of every bucket each rank owns);
* :mod:`~distopt.sharding.sync`: the bucket sync the step engine holds
  (all-reduce or reduce-scatter per bucket, where a result lands, the
  finiteness vote, the update of array models);
* :mod:`~distopt.sharding.gather`: the parameters' all-gather after a
  sharded update;
* :mod:`~distopt.sharding.frame`: ``zero=3``'s check frame, shared by the
  step header and the parameter gathers' checks;
* :mod:`~distopt.sharding.shard_state`: every rank's pieces of a sharded
  optimizer state merged into torch's layout.

The torch half (shard tensors, ``.grad`` placeholders, stage 3's parameter
segments and model hooks, sharded clipping and checkpoints) is
:mod:`distopt.torch.zero`, in the torch layer above. Outside these two the
stage is only passed through: the engine is given a
:class:`~distopt.sharding.sync.BucketSync`, the torch follower a gradient
sink, the checkpoint state a sharded state.
"""
