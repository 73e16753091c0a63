import os
import signal
import sys
import time
from pathlib import Path

import pytest

# Test helpers (tests/_dist.py, tests/loader_scenarios.py) must be importable by spawned ranks too.
sys.path.insert(0, str(Path(__file__).parent))

# A DataLoader worker notices that its parent died within torch's status interval (5 s); a process still
# running this long after its test ended was left behind.
_LEFTOVER_GRACE_S = 15.0
# Long-lived helpers the multiprocessing module starts once per session in *this* process (not leftovers).
_SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers) each worker gets a process group of its own, so the
    leftover check below sees only the processes of its own worker's tests."""
    if hasattr(config, "workerinput"):
        os.setpgrp()


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _live_in_group() -> set[int]:
    """Running (not zombie) processes of this process group: children, grandchildren, and orphans (a process
    whose parent died is re-parented but keeps its group, so it still shows here)."""
    me, group, out = os.getpid(), os.getpgrp(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        st = _stat(int(entry))
        if st is not None and st[0] != "Z" and st[2] == group:
            out.add(int(entry))
    return out


def _is_session_helper(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == os.getpid() and any(h in _cmdline(pid) for h in _SESSION_HELPERS)


@pytest.fixture(autouse=True)
def no_leftover_processes(request):
    """Issue 21, item 9: a multi-process test must not leave a process behind (a rank, a DataLoader worker).

    Compares this process group's running processes before and after the test; what is still running
    ``_LEFTOVER_GRACE_S`` after the test is killed (by pid) and fails the test, named with its command line.
    """
    if request.node.get_closest_marker("multiprocess") is None or not os.path.isdir("/proc"):
        yield
        return
    before = _live_in_group()
    yield
    deadline = time.monotonic() + _LEFTOVER_GRACE_S
    while True:
        left = {p for p in _live_in_group() - before if not _is_session_helper(p)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if left:
        named = {p: _cmdline(p)[:200] for p in sorted(left)}
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"the test left {len(left)} process(es) running {_LEFTOVER_GRACE_S:g} s after it ended "
                    f"(killed now): {named}")
