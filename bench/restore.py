"""Benchmark: restore of one rank's image, clone path (before issue 9) vs in place.

Run:  .venv/bin/python bench/restore.py                 (64 and 256 MiB, best of 3)
      .venv/bin/python bench/restore.py --sizes 64 --reps 5

State, two layouts of a model plus its AdamW moments after one step
(parameters are a third of the bytes), plus the RNG streams: "layers", an
``nn.Sequential`` of 1024x1024 ``Linear`` layers (4 MiB tensors), and
"shard", one flat parameter of S/12 elements as in ``bench/recovery.py``.
The layout matters for the clone path: glibc serves 4 MiB blocks from its
heap, reusing the pages the previous restore freed, while tensors above its
32 MiB mmap threshold get fresh, page-faulting memory on every clone. One image is captured; then, alternating, ``restore(...,
in_place=False)`` (fresh clones handed to every ``load_state_dict``: the only
path before) and ``restore(...)`` (copies into the live tensors). Both verify
the CRC32C checksums first, as the job loop does; "verify" is that part.
GB/s = image bytes / restore seconds. Best of ``--reps`` each, same process;
"load only" is the best restore time minus its checksum verification.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptless.state import Capturer, RestoreReport, StateRegistry, restore  # noqa: E402

MIB = 1 << 20


class Shard(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(numel))


def build(size_mib: int, layout: str, device: str = "cpu") -> StateRegistry:
    torch.manual_seed(0)
    model: nn.Module
    if layout == "shard":
        model = Shard(size_mib * MIB // 12)
    else:
        layer_bytes = (1024 * 1024 + 1024) * 4
        n_layers = max(1, round(size_mib * MIB / 3 / layer_bytes))
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(n_layers)])
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    reg = StateRegistry()
    reg.protect(model=model, optimizer=opt)
    return reg


def timed(reg: StateRegistry, img: object, in_place: bool) -> tuple[float, RestoreReport]:
    t0 = time.perf_counter()
    rep = restore(reg, img, in_place=in_place)  # type: ignore[arg-type]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="state per rank, MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="where the model lives (cuda: restore copies host-to-device)")
    ap.add_argument("--layouts", nargs="+", default=["layers", "shard"], choices=["layers", "shard"])
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model on {args.device}")
    print("| state | layout | image MiB | clone path s | GB/s | in place s | GB/s | speedup "
          "| verify s | load only: clone s | load only: in place s | in place / cloned MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size, layout in [(s, lay) for s in args.sizes for lay in args.layouts]:
        reg = build(size, layout, args.device)
        img = Capturer(reg, "bench", 0).capture(0, 0)
        nbytes = img.manifest.total_bytes
        old: list[tuple[float, RestoreReport]] = []
        new: list[tuple[float, RestoreReport]] = []
        for _ in range(args.reps):
            old.append(timed(reg, img, in_place=False))
            new.append(timed(reg, img, in_place=True))
        (o, _), (n, rep_new) = min(old, key=lambda r: r[0]), min(new, key=lambda r: r[0])
        assert rep_new.cloned_bytes < MIB, rep_new.fallbacks()
        print(
            f"| {size} MiB | {layout} | {nbytes / MIB:.0f} | {o:.3f} | {nbytes / o / 1e9:.2f} | {n:.3f} "
            f"| {nbytes / n / 1e9:.2f} | {o / n:.1f}x | {rep_new.verify_s:.3f} "
            f"| {min(r.load_s for _, r in old):.3f} | {min(r.load_s for _, r in new):.3f} "
            f"| {rep_new.in_place_bytes / MIB:.0f} / {rep_new.cloned_bytes / MIB:.2f} |"
        )

if __name__ == "__main__":
    main()
