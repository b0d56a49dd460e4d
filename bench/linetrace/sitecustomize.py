"""Counts the Python lines each function runs, for `bench/hotspots.py --lines`.

Python imports `sitecustomize` at start-up from its path: `bench/hotspots.py --lines` puts
this directory on the services' PYTHONPATH and names a directory in ROLLGATE_LINE_TRACE_DIR.
Then every Python thread counts each line it runs against its function (`sys.settrace`, five
to ten times slower: the counts are the point, not the time; a thread C code started, such as
gRPC's own, is not counted); SIGUSR2 starts the count again (the
measurement begins after the warm-up); at exit the counts go to
`<dir>/<service>-<pid>.tsv`, one `count<TAB>file:first line<TAB>function` row per function.
A count is exact where a sample is not: a loop that runs per chunk shows as lines per request
in the dozens or hundreds. Without the variable this module does nothing. (It takes the
place of an interpreter's own `sitecustomize`, which Debian's python3 has, while it is on the
path: only the services of a `--lines` run see it.)
"""

from __future__ import annotations

import os

_DIR = os.environ.get("ROLLGATE_LINE_TRACE_DIR")

if _DIR:
    import atexit
    import collections
    import signal
    import sys
    import threading
    from types import CodeType, FrameType
    from typing import Any

    _counts: collections.Counter[CodeType] = collections.Counter()

    def _line(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            _counts[frame.f_code] += 1
        return _line

    def _call(frame: FrameType, event: str, arg: Any) -> Any:
        return _line

    def _restart(signum: int, frame: Any) -> None:
        _counts.clear()

    def _service() -> str:
        # `python -m services.gateway` runs services/gateway/__main__.py as argv[0].
        parts = sys.argv[0].replace("\\", "/").split("/")
        return parts[-2] if parts[-1] == "__main__.py" and len(parts) > 1 else parts[-1]

    def _dump() -> None:
        counts = sorted(_counts.items(), key=lambda item: -item[1])
        path = os.path.join(_DIR, f"{_service()}-{os.getpid()}.tsv")
        with open(path, "w", encoding="utf-8") as out:
            for code, count in counts:
                where = f"{code.co_filename}:{code.co_firstlineno}"
                out.write(f"{count}\t{where}\t{code.co_qualname}\n")

    sys.settrace(_call)
    threading.settrace(_call)
    signal.signal(signal.SIGUSR2, _restart)
    atexit.register(_dump)
