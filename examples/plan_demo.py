"""Planner demo (what `make demo` runs until the Lightning strategy lands).

Prints the seed's Table 1 with concrete numbers for W=4 workers, the FSLPP plan with its
timeline, and writes the timeline PNG to out/fslpp_w4.png. Pure Python: no torch needed.
"""

from __future__ import annotations

import os

from lightning_gsched.cli import main

if __name__ == "__main__":
    os.makedirs("out", exist_ok=True)
    print("== every library schedule, W=4 workers, S=4 stages, B=8 microbatches ==")
    main(["compare", "--workers", "4", "--stages", "4", "--microbatches", "8"])
    print("\n== fslpp in detail ==")
    main(["plan", "fslpp", "--workers", "4", "--stages", "4", "--microbatches", "8", "--R", "2",
          "--png", "out/fslpp_w4.png"])
