"""``kernels.openmp.serial_thread``: a thread that calls it computes on itself alone, so the
process keeps one OpenMP team (see the module for the 1.6x a second team costs on 2 cores).

Each case runs in a fresh interpreter: libgomp's teams live as long as the threads that made
them, so this process's earlier tests would decide the thread counts seen here."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, os, threading, torch
from kernels.openmp import serial_thread
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
ids = torch.randperm(1024)
def tasks(): return len(os.listdir("/proc/self/task"))
def work(serial, seen):
    if serial:
        serial_thread()
    before = tasks()
    for _ in range(20):
        a.index_select(0, ids).sum()  # what KV copies and checksums do: gathers, adds, sums
        torch.empty_like(a).copy_(a + a)
    seen.update(threads=torch.get_num_threads(), before=before, after=tasks())
result = {}
for name in ("serial", "default"):
    seen = {}
    t = threading.Thread(target=work, args=(name == "serial", seen)); t.start(); t.join()
    result[name] = seen
result["main"] = torch.get_num_threads()
print(json.dumps(result))
"""


def test_a_serial_thread_starts_no_openmp_team_and_leaves_other_threads_alone():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    serial, default = result["serial"], result["default"]
    assert serial["threads"] == 1
    assert serial["after"] == serial["before"], serial  # its regions ran on itself
    assert default["threads"] == 2 and result["main"] == 2
    assert default["after"] > default["before"], default  # the control: a team was started
