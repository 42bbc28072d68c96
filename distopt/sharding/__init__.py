"""The array half of sharding (ZeRO): what differs between ``zero=0``, 1, 2 and 3 in the step layer.

The shard plan (:mod:`~distopt.sharding.plan`), the engine's policy (:mod:`~distopt.sharding.policy`), each step's
sync (:mod:`~distopt.sharding.sync`), the parameters' all-gather (:mod:`~distopt.sharding.gather`), ``zero=3``'s check
frame (:mod:`~distopt.sharding.frame`) and the merging of sharded optimizer states (:mod:`~distopt.sharding.shard_state`). The torch half is
:mod:`distopt.torch.zero`; elsewhere the stage is only passed through (the engine is given a
:class:`~distopt.sharding.policy.BucketSync`, the torch follower a gradient sink, the checkpoint state a sharded state).
"""
