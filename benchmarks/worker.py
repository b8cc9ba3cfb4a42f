"""``python -m benchmarks.worker SPEC``: one rank of a benchmark job (started by common.launch)."""

import sys

from benchmarks.common import run_in_worker

if __name__ == "__main__":
    run_in_worker(sys.argv[1])
