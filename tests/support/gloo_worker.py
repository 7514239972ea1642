"""A stand-in worker for the local launcher's socket test: it joins the launcher's process group
over gloo (env://, the launcher's store, as ftcore's workers do), writes `ready<rank>` under
argv[1], and waits for SIGTERM, so the test can read every socket the run listens on."""

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

stop: list[int] = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
dist.init_process_group("gloo")
dist.barrier()
(Path(sys.argv[1]) / f"ready{os.environ['RANK']}").write_text(str(os.getpid()))
while not stop:
    time.sleep(0.05)
dist.destroy_process_group()
