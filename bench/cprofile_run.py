"""Runs a module under cProfile with a CPU clock (not wall time): `python bench/cprofile_run.py
OUT MODULE [args…]` writes the profile to OUT when the module returns or the process exits.

bench/hotspots.py `--cprofile SERVICE` starts that service this way: a deterministic count of
calls and of the CPU each function used, which py-spy's sampling cannot give for code that is
mostly short calls (its samples also land on blocking system calls).
"""

from __future__ import annotations

import atexit
import contextlib
import cProfile
import os
import runpy
import sys
import time


def main() -> None:
    """Profiles argv[2] as `python -m`, writing the stats to argv[1]."""
    out, module = sys.argv[1], sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    # As `python -m` has it: the working directory (the checkout being run, `--rollgate-root`)
    # first, not this script's (else an editable install's checkout is what gets profiled).
    sys.path[0] = os.getcwd()
    profile = cProfile.Profile(time.thread_time)

    def dump() -> None:
        profile.disable()
        profile.dump_stats(out)

    atexit.register(dump)
    profile.enable()
    with contextlib.suppress(SystemExit):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
