"""The CUDA generator in an image restores exactly in a new process (usage: rng_device.py save|load FILE).

``save``: seed, draw on the GPU, capture the RNG state (as the image holds it: the current device's
generator only), draw 8 more and store both. ``load``: a new process restores the state and must
draw the same 8 numbers.
"""

from __future__ import annotations

import sys

import torch

from ckptless.state import RNGState

MODE, PATH = sys.argv[1], sys.argv[2]
torch.cuda.set_device(torch.cuda.device_count() - 1)  # the last GPU: the device index is not what is saved

if MODE == "save":
    torch.manual_seed(123)
    torch.rand(100, device="cuda")
    state = RNGState().state_dict()
    assert len(state["cuda"]) == 1, f"one CUDA generator expected, got {len(state['cuda'])}"
    torch.save({"state": state, "draws": torch.rand(8, device="cuda").cpu()}, PATH)
else:
    saved = torch.load(PATH, weights_only=True)
    torch.rand(3, device="cuda")  # this process's generator is elsewhere before the restore
    RNGState().load_state_dict(saved["state"])
    got = torch.rand(8, device="cuda").cpu()
    assert torch.equal(got, saved["draws"]), (got, saved["draws"])
    print("rng exact")
