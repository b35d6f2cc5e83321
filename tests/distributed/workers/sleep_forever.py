"""A torchrun worker for tests/distributed/test_launch.py: appends its pid to argv[1] and sleeps."""
import os
import sys
import time

with open(sys.argv[1], "a") as pids:
    pids.write(f"{os.getpid()}\n")
time.sleep(3600)
