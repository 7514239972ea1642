"""A stand-in worker for the local launcher's tests (no torch, starts in a blink): it writes
`ready` then waits; a SIGINT/SIGTERM/SIGUSR1 is counted in rank<N>.txt under argv[1], the first
makes it exit 3 after argv[2] seconds (a save), a second SIGINT exits 130 at once (an abort)."""

import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ["RANK"]
got: list[str] = []


def handler(signum, _frame):
    got.append(signal.Signals(signum).name)
    (out / f"rank{rank}.txt").write_text(" ".join(got))
    if got.count("SIGINT") > 1:
        os._exit(130)


for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(s, handler)
(out / f"ready{rank}").write_text("")
while not got:
    time.sleep(0.01)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    time.sleep(0.01)
sys.exit(3)
