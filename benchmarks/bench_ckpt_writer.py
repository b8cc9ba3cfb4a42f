"""How to write a full checkpoint of a model larger than one rank into one ``torch.load`` file.

Why: rank 0 receives the model one weight unit at a time (``runtime/fullstate.py``); the
question is how the file gets written without rank 0 holding the model. Each candidate runs in a
fresh process on N units of U bytes, each unit made (as a received buffer is) only when the
transfer reaches it, and reports wall time, the peak of anonymous memory (sampled every 2 ms:
what the process holds itself, the page cache of a file mapping excluded) and the bytes written
to disk, and checks that ``torch.load`` (and ``weights_only=True``) returns the units:

* ``gathered``: every unit kept, then one ``torch.save`` (what the gathered path does);
* ``dcp``: ``torch.distributed.checkpoint.save`` (each rank would write its own part) and
  ``format_utils.dcp_to_torch_save`` to make the one file;
* ``skip_data``: ``torch.save`` of the skeleton under ``torch.serialization.skip_data`` (fake
  tensors for the units, no bytes written), then the file loaded with ``mmap=True`` and
  ``MAP_SHARED`` and each unit copied into its mapped tensor as it arrives;
* ``scratch``: each unit appended to a scratch file as it arrives, then ``torch.save`` of the
  checkpoint whose tensors are views of that file mapped (``UntypedStorage.from_file``);
* ``streamed``: the package's writer (``engine/checkpoint_files.save_streamed``): the pickle
  first, then each unit written as its own zip record as it arrives.

    python -m benchmarks.bench_ckpt_writer [--units 16] [--unit-mib 32] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from typing import Any, Callable, Iterator

import torch

CANDIDATES = ("gathered", "dcp", "skip_data", "scratch", "streamed")


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """The most anonymous memory the process held while the block ran, above its start."""

    def __init__(self) -> None:
        self.base = _rss_anon()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.002)

    def __enter__(self) -> PeakAnon:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


SCRATCH: dict[str, int] = {}  # bytes written to a scratch file (removed by then)


def _tree_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(directory) for name in names)


def units(n: int, numel: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Unit i's values, made when asked (the transfer's received buffer), never kept here."""
    for i in range(n):
        yield i, torch.full((numel,), float(i))


def _skeleton(n: int, numel: int, make: Callable[[int], Any]) -> dict[str, Any]:
    return {"state_dict": {f"unit{i}.weight": make(i) for i in range(n)}, "global_step": 1,
            "buffer": torch.arange(4.0)}


def run_gathered(path: str, n: int, numel: int) -> None:
    checkpoint = _skeleton(n, numel, lambda i: None)
    for i, tensor in units(n, numel):
        checkpoint["state_dict"][f"unit{i}.weight"] = tensor
    torch.save(checkpoint, path)


def run_dcp(path: str, n: int, numel: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = path + ".dir"
    state = _skeleton(n, numel, lambda i: None)
    for i, tensor in units(n, numel):  # in a job, each rank writes its own units
        state["state_dict"][f"unit{i}.weight"] = tensor
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    del state, tensor
    dcp_to_torch_save(directory, path)


def run_skip_data(path: str, n: int, numel: int) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        checkpoint = _skeleton(n, numel, lambda i: torch.empty(numel))
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(checkpoint, path)
    flags = torch.serialization.get_default_mmap_options()
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)
    try:
        mapped = torch.load(path, mmap=True, weights_only=False)
    finally:
        torch.serialization.set_default_mmap_options(flags)
    mapped["buffer"].copy_(torch.arange(4.0))  # every storage is skipped, the real ones too
    for i, tensor in units(n, numel):
        mapped["state_dict"][f"unit{i}.weight"].copy_(tensor)
    del mapped


def run_scratch(path: str, n: int, numel: int) -> None:
    scratch = path + ".scratch"
    with open(scratch, "wb") as f:
        for _, tensor in units(n, numel):
            f.write(memoryview(tensor.numpy()))
    SCRATCH["bytes"] = os.path.getsize(scratch)
    flat = torch.from_file(scratch, shared=False, size=n * numel, dtype=torch.float32)
    torch.save(_skeleton(n, numel, lambda i: flat[i * numel:(i + 1) * numel]), path)
    os.unlink(scratch)


def run_streamed(path: str, n: int, numel: int) -> None:
    from lightning_gsched.engine.checkpoint_files import save_streamed
    from lightning_gsched.runtime import StreamedTensor

    placeholders = [StreamedTensor((numel,), torch.float32, 1, f"unit {i}", i) for i in range(n)]
    checkpoint = _skeleton(n, numel, lambda i: placeholders[i])

    def stream(sink: Any, on_hold: Callable[[int], None]) -> None:
        for i, tensor in units(n, numel):
            if sink is not None:
                sink(placeholders[i], tensor)

    save_streamed(checkpoint, path, stream)


def _import_everything() -> None:
    """What the candidates import, loaded before anything is measured."""
    import torch.distributed.checkpoint.format_utils  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401

    import lightning_gsched.engine.checkpoint_files  # noqa: F401


def one(candidate: str, directory: str, n: int, numel: int) -> dict[str, Any]:
    path = os.path.join(directory, f"{candidate}.ckpt")
    run = globals()[f"run_{candidate}"]
    _import_everything()
    start = time.perf_counter()
    with PeakAnon() as peak:
        run(path, n, numel)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    written = os.path.getsize(path) + SCRATCH.get("bytes", 0) + _tree_bytes(path + ".dir")
    loaded = torch.load(path, weights_only=True)["state_dict"]
    correct = all(torch.equal(loaded[f"unit{i}.weight"], torch.full((numel,), float(i)))
                  for i in range(n))
    try:
        crc_ok = zipfile.ZipFile(path).testzip() is None
    except zipfile.BadZipFile:
        crc_ok = False
    return {"candidate": candidate, "seconds": round(seconds, 2),
            "peak_anon_mib": round((peak.peak - peak.base) / 2**20),
            "file_mib": round(os.path.getsize(path) / 2**20), "correct": correct,
            "zip_crc_ok": crc_ok, "written_mib": round(written / 2**20)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=16)
    parser.add_argument("--unit-mib", type=int, default=32)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--one", choices=CANDIDATES)
    args = parser.parse_args(argv)
    numel = args.unit_mib * 2**20 // 4
    if args.one:
        print(json.dumps(one(args.one, args.dir, args.units, numel)))
        return
    print(f"{args.units} units of {args.unit_mib} MiB ({args.units * args.unit_mib} MiB)")
    for candidate in CANDIDATES:
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            out = subprocess.run([sys.executable, "-m", "benchmarks.bench_ckpt_writer",
                                  "--one", candidate, "--dir", directory, "--units",
                                  str(args.units), "--unit-mib", str(args.unit_mib)],
                                 capture_output=True, text=True, check=False)
            print(out.stdout.strip() or out.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
