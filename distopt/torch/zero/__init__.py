"""The torch half of sharding (``DistOpt(torch_optimizer, zero=1|2|3)``), over the array half in
:mod:`distopt.sharding`: the shard tensors and the parameters' all-gather (:mod:`~distopt.torch.zero.step`), what is
refused (:mod:`~distopt.torch.zero.placeholder`), checkpoints and the wiring of a stage
(:mod:`~distopt.torch.zero.state`), sharded clipping (:mod:`~distopt.torch.zero.clip`), and stage 3's gradient sink,
parameter segments and model hooks (:mod:`~distopt.torch.zero.full`, :mod:`~distopt.torch.zero.params`,
:mod:`~distopt.torch.zero.hooks`), its materialization of a model built on the meta device
(:mod:`~distopt.torch.zero.materialize`) and its mixed precision (:mod:`~distopt.torch.zero.precision`; at stages 1
and 2: :mod:`~distopt.torch.zero.mixed_step`).
"""
