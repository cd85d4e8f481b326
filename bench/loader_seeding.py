"""What seeding loader workers per sample costs (ckptless/sample_seeds.py), against the plain DataLoader.

A map-style dataset whose sample is a small image with a random crop and flip
drawn from the worker's torch, ``random`` and NumPy streams (tens of
microseconds a sample: a light sample, where the seeding shows most; a real
image's decoding takes milliseconds). The same loader (batch 64, 2 workers)
passes over it with its plain ``worker_init_fn`` and with
:class:`ckptless.sample_seeds.SeedPerSample`, keyed by batch as ``job.batches``
does and by sample as ``ckptless.data`` does; best of ``--reps`` passes each,
interleaved. Then, in the training process, what ``job.batches`` does per batch
before each fetch (``LoopPosition.before_fetch``: the streams the fetch may draw
from, NumPy's only without workers) and the bytes of the loop's image entry.

    .venv/bin/python bench/loader_seeding.py [--samples 16384] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import random
import time
import timeit

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ckptless.passes import LoopPosition
from ckptless.sample_seeds import SeedPerSample


class CroppedImages(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((3, 40, 40), float(i))
        a, b = random.randint(0, 8), int(np.random.randint(0, 8))
        x = x[:, a:a + 32, b:b + 32]
        return x.flip(2) if torch.rand(()) < 0.5 else x


def one_pass(loader: DataLoader[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for _batch in loader:
        pass
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    modes = {"plain": None, "per sample, by batch (job.batches)": SeedPerSample(None),
             "per sample, by index (ckptless.data)": SeedPerSample(None, 7, 0)}
    loaders = {name: DataLoader(CroppedImages(args.samples), batch_size=64, num_workers=2, worker_init_fn=init)
               for name, init in modes.items()}
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(args.reps):  # interleaved: a busy moment of the machine hits every mode alike
        for name, loader in loaders.items():
            best[name] = min(best[name], one_pass(loader))
    print("| worker_init_fn | pass (s) | us per sample | x plain |")
    print("|---|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t:.3f} | {t / args.samples * 1e6:.1f} | {t / best['plain']:.2f} |")
    pos = LoopPosition()
    for in_process in (False, True):
        us = min(timeit.repeat(lambda: pos.before_fetch(in_process), number=2000, repeat=5)) / 2000 * 1e6
        print(f"before each fetch ({'no workers: torch, random, NumPy' if in_process else 'workers: torch, random'}): "
              f"{us:.1f} us")
    pos.cpu_rng, pos.loader_rng = torch.get_rng_state(), torch.Generator().get_state()
    entry = sum(t.numel() * t.element_size() for t in _tensors(pos.state_dict()))
    print(f"the loop's image entry (opened pass, no workers): {entry / 1024:.1f} KiB of tensors")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()
