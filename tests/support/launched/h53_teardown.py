"""H53 under torchrun: the script owns the process group (``dist.init_process_group("gloo")``), trains 3
steps with distopt, then tears down in the order given by ``argv[1]``:

* ``destroy``: ``dist.destroy_process_group()`` only;
* ``destroy_close``: destroy, then ``opt.close()`` (as ``with DistOpt(...)`` or ``finally:`` does);
* ``close_destroy``: close, then destroy;
* ``neither``: nothing.

Prints ``H53 <rank> <order> <params>`` before tearing down.
"""
import sys

import torch
import torch.distributed as dist

import distopt

order = sys.argv[1]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
g = torch.Generator().manual_seed(dist.get_rank())
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 3, generator=g)).pow(2).mean().backward()
    opt.step()
params = [round(float(v), 12) for v in torch.cat([p.detach().reshape(-1) for p in model.parameters()])]
print(f"H53 {dist.get_rank()} {order} {params}", flush=True)
if order == "destroy":
    dist.destroy_process_group()
elif order == "destroy_close":
    dist.destroy_process_group()
    opt.close()
elif order == "close_destroy":
    opt.close()
    dist.destroy_process_group()
