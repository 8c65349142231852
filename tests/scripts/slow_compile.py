"""A kernel whose compilation takes SLOW_COMPILE_S seconds (its typing sleeps),
for tests/test_kernels_shared_compiles.py. Run as a script it waits until the
wall-clock time START_AT, calls the kernel and prints JSON: this process's
cache misses (compilations) and hits (loaded from the disk cache)."""
import json
import os
import sys
import time

from numba.extending import intrinsic

from kernels.shared_compiles import cached_njit


@intrinsic
def _slow_identity(typingctx, x):
    time.sleep(float(os.environ.get("SLOW_COMPILE_S", "1")))

    def codegen(context, builder, signature, args):
        return args[0]

    return x(x), codegen


@cached_njit
def slow_plus_one(x):
    return _slow_identity(x) + 1


if __name__ == "__main__":
    time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
    value = slow_plus_one(41)
    stats = slow_plus_one.stats
    print(json.dumps({"value": int(value), "misses": sum(stats.cache_misses.values()),
                      "hits": sum(stats.cache_hits.values())}))
