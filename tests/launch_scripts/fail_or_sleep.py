"""A rank of tests/test_launch_cpu.py (no jax): prints its pid, then the rank named by argv[1] prints a few
lines and exits with code argv[2] (or kills itself with signal -argv[2]); every other rank sleeps. With
argv[1] = -1 every rank sleeps (for the signal and timeout tests)."""

import os
import sys
import time

rank = int(os.environ["JAX_PROCESS_ID"])
failing, code = int(sys.argv[1]), int(sys.argv[2])
print(f"PID {rank} {os.getpid()}", flush=True)
if rank == failing:
    time.sleep(0.5)  # the other ranks are up and sleeping
    for i in range(25):
        print(f"line {i} of rank {rank}", flush=True)
    print("about to fail", file=sys.stderr, flush=True)
    if code < 0:
        os.kill(os.getpid(), -code)
    sys.exit(code)
time.sleep(300)
