"""A plain torchrun script that was never ported: it never calls ``ckptless.init()``."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size()
dist.destroy_process_group()
