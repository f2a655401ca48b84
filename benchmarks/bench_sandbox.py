"""Sandbox benchmark: tool-call latency (tool server vs plain `docker exec`) and acquire latency (warm pool
vs cold start), at 1 and 16 concurrent episodes. Same as `reflow sandbox bench`; see reflow/sandbox/bench.py.

Usage: python benchmarks/bench_sandbox.py [--concurrency 1,16] [--calls 200] [--acquires 64] [--json]
Needs a Docker engine and the sandbox image (`reflow sandbox build`).
"""

import sys

from reflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["sandbox", "bench", *sys.argv[1:]]))
