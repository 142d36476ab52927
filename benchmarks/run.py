"""Run the benchmark suite and store results in benchmarks/results/ (latest.md, latest.json).

    .venv/bin/python benchmarks/run.py            # the full suite (about 10-20 minutes on 2 cores)
    .venv/bin/python benchmarks/run.py --layers 2,8 --steps 50
"""

import os
import sys

from piecewise.cli import main

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(main(["bench", "--out", os.path.join(here, "results"), *sys.argv[1:]]))
