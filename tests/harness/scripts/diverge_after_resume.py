"""A script whose ranks run different collectives after every resume (issue 38's failure, made exact).

After a recovery rank 0 waits in a receive nobody sends, while its peers all-reduce: every generation
after the first recovery ends in the collective timeout, nobody dead. The job must end with
``CollectivesDiverged`` after two such generations, not recover for ever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ckptless


def main() -> None:
    torch.manual_seed(0)
    job = ckptless.init()
    model = torch.nn.Linear(4, 4)
    job.protect(model=model)

    def step(_s: int) -> None:
        if job.recoveries > 0 and job.rank == 0:
            dist.recv(torch.zeros(1), src=1)  # the peers are in an all-reduce
        t = torch.ones(4)
        dist.all_reduce(t)
        with torch.no_grad():
            model.weight.add_(t.sum() * 1e-3)

    job.run(step, steps=20)
    job.close()


if __name__ == "__main__":
    main()
