"""The optimizer's step in the bytes model: its temporaries, measured by the OS, and the moment
the model adds after the program.

``runtime.optimizer_step_factor`` says what ``optimizer.step()`` allocates for its duration per
parameter byte. It is checked here against the process: a fresh interpreter with glibc's mmap
threshold pinned low (every large tensor is its own mapping, returned to the OS when freed, so
the resident high-water mark rises by exactly the temporaries' pages) runs two Adam steps, resets
``VmHWM`` and reads how far a third step raises it. The bound is 5% of the parameters: the
interpreter's own pages during a step are a few hundred KiB against 64 MiB of parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_gsched.runtime import optimizer_step_factor
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.memory import predict_memory
from sizes import uniform_sizes

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="needs Linux's /proc/self/clear_refs to reset VmHWM")

PROBE = r"""
import json, sys
from pathlib import Path
import torch

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(2048, 2048)) for _ in range(4)]
optimizer = getattr(torch.optim, sys.argv[1])(params, lr=1e-3, **json.loads(sys.argv[2]))
for p in params:
    p.grad = torch.randn_like(p)
optimizer.step()
optimizer.step()  # the state exists; allocator warm
Path("/proc/self/clear_refs").write_text("5")
start = status("VmRSS")
optimizer.step()
print(json.dumps((status("VmHWM") - start) / sum(p.numel() * 4 for p in params)))
"""

CASES = [
    ("Adam", {"foreach": True, "weight_decay": 0.1}),  # its gradient copy is gone by the sqrt
    ("AdamW", {"foreach": True, "weight_decay": 0.1}),
    ("Adam", {"fused": True}),
]


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_the_step_factor_is_what_the_process_allocates(name: str, options: dict) -> None:
    import torch

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE, name, json.dumps(options)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    optimizer = getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(2))], lr=1e-3,
                                           **options)
    assert measured == pytest.approx(optimizer_step_factor(optimizer), abs=0.05)


def test_torch_picks_the_multi_tensor_step_on_cuda_only_when_not_told() -> None:
    import torch

    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert optimizer_step_factor(adam) == 0.0  # CPU: the per-parameter loop
    assert optimizer_step_factor(adam, "cuda") == 1.0
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, foreach=True)
    assert optimizer_step_factor(sgd, "cuda") == 0.0


def test_the_model_adds_the_step_after_the_program() -> None:
    """fsdp at W=4: the step's moment is owned weights + gradients + state + factor x the
    gradients; with a large factor it is the peak, computed here from the rank's owned
    stages."""
    p = plan("fsdp", workers=4, stages=8)
    sizes = uniform_sizes(p.stages, 1000, 10, 1)
    sizes = type(sizes)(tuple(type(st)(**{**st.__dict__, "optimizer": 5000})
                              for st in sizes.stages), sizes.ties)
    plain = predict_memory(p.programs, sizes)
    stepped = predict_memory(p.programs, type(sizes)(sizes.stages, sizes.ties, 5.0))
    for rank, (a, b) in enumerate(zip(plain, stepped, strict=True)):
        owned = p.programs.owned_stages(rank)
        weights = grads = 1000 * len(owned)
        state = 5000 * len(owned)
        step = weights + grads + state + 5 * grads
        assert step > a.peak and b.peak == step, rank
        assert b.at_peak.activations == 0 and b.at_peak.communication == 0, rank
        assert b.category_peaks.activations == a.category_peaks.activations, rank
