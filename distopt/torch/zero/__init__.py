"""The torch half of sharding (``DistOpt(torch_optimizer, zero=1|2|3)``), over the array half in
:mod:`distopt.sharding`.

* :mod:`~distopt.torch.zero.step`: the shard tensors the inner optimizer
  steps, the parameters' all-gather after the update;
* :mod:`~distopt.torch.zero.placeholder`: what is refused (a non-elementwise
  update, any use of ``.grad`` at ``zero=2|3``);
* :mod:`~distopt.torch.zero.state`: checkpoints (consolidated or per rank)
  and the wiring of a stage (:func:`~distopt.torch.zero.state.torch_sharding`);
* :mod:`~distopt.torch.zero.clip`: clipping by the global norm of the shards;
* stage 3: :mod:`~distopt.torch.zero.full` (its gradient sink),
  :mod:`~distopt.torch.zero.params` (the parameter segments, their gathers
  and frees) and :mod:`~distopt.torch.zero.hooks` (the model hooks that
  decide when).
"""
