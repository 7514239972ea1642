"""The one wrapper every entry point uses: compose the config, run, map errors to exit statuses.

`python -m ftcore.X [overrides]` -> `main(task, argv)`:
- `--cfg job` prints the composed config and exits; `-h/--help` prints usage; `--verbose` lets the
  libraries' own warnings through (quiet by default: see `quiet_libraries`);
- FtcoreError -> one line on stderr, exit 2 (no traceback);
- StopRequested -> exit 3 (checkpoint saved, requeue me);
- anything else -> traceback, exit 1 (a crash, not requeued).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from ftcore.errors import EXIT_OK, EXIT_REQUEUE, EXIT_USER_ERROR, FtcoreError, StopRequested

log = logging.getLogger("ftcore")
VERBOSE_ENV = "FTCORE_VERBOSE"  # set by --verbose; local workers inherit it


def setup_logging() -> None:
    """Plain log lines on stderr; rank-prefixed when several ranks share a terminal."""
    rank = os.environ.get("RANK")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank{rank}] " if rank is not None and world > 1 else ""
    level = os.environ.get("FTCORE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level, format=f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S", force=True
    )
    for noisy in ("megatron", "torch.distributed", "datasets", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_libraries(os.environ.get(VERBOSE_ENV) == "1")


def quiet_libraries(verbose: bool) -> None:
    """Warnings about the libraries, not the user's run, stay out of the way unless --verbose:
    megatron-core's UserWarnings at import (no Apex or TE on CPU, its own deprecated defaults),
    torch's and megatron's FutureWarnings, and
    bitsandbytes' CPU-kernel message, which appears on runs that never quantise anything."""
    if verbose:
        return
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    # torch's and megatron's deprecation notices about their own APIs (ShardedTensor, the
    # checkpoint loader's load_state_dict), per rank on every resume: nothing the user can change.
    # ftcore.runtime.cpu is where the CPU runtime calls into them (the warnings point there).
    for where in (r"megatron\.", r"torch\.", r"ftcore\.runtime\.cpu"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=where)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


USAGE = """usage: python -m ftcore.{name} [+exp=NAME] [key=value ...] [--cfg job]

Overrides use Hydra syntax: `parallel.tp=2`, `model=llama3_8b`, `+exp=tiny_lora`.
`--cfg job` prints the composed config and exits; `--info [all|config|defaults|defaults-tree|
plugins|searchpath]` prints Hydra's information; `--verbose` shows the libraries' own warnings.
docs/design.md describes every section."""


def main(name: str, task: Callable[[DictConfig], int | None], argv: list[str] | None = None) -> int:
    """Run `task(cfg)` with the exit-status contract (docs/design.md); returns the exit status."""
    from ftcore.config.schema import HYDRA_INFO, compose, to_yaml
    from ftcore.runtime import megatron_jit

    megatron_jit.install()  # before megatron-core is imported: no torch.compile without CUDA
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in argv:
        argv.remove("--verbose")
        os.environ[VERBOSE_ENV] = "1"
    setup_logging()
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.format(name=name))
        return EXIT_OK
    info = None
    for flag in ("--info", "-i"):  # Hydra's own flag: print what Hydra prints, then exit
        if flag in argv:
            i = argv.index(flag)
            has_arg = i + 1 < len(argv) and argv[i + 1] in HYDRA_INFO
            info = argv[i + 1] if has_arg else "all"
            del argv[i : i + 1 + has_arg]
    print_cfg = False
    if "--cfg" in argv:
        i = argv.index("--cfg")
        print_cfg = True
        del argv[i : i + 2 if i + 1 < len(argv) and not argv[i + 1].count("=") else i + 1]
    try:
        if info is not None:
            compose(argv, info=info)
            return EXIT_OK
        cfg = compose(argv)
        if print_cfg:
            print(to_yaml(cfg), end="")
            return EXIT_OK
        status = task(cfg)
        return EXIT_OK if status is None else int(status)
    except FtcoreError as e:
        report_user_error(f"ftcore error: {e}")
        return EXIT_USER_ERROR
    except StopRequested as e:
        if os.environ.get("RANK", "0") == "0":  # one line, not one per rank
            log.warning(str(e))
        return EXIT_REQUEUE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        return 1


def report_user_error(line: str) -> None:
    """One line on stderr; a local worker (ftcore.runtime.dist.launch_local_workers) hands it to
    its launcher instead, which prints one rank's line once, last."""
    errors = os.environ.get("FTCORE_WORKER_ERROR_DIR")
    if errors and os.path.isdir(errors) and "RANK" in os.environ:
        with open(os.path.join(errors, f"rank{os.environ['RANK']}"), "w") as f:
            f.write(line + "\n")
        return
    print(line, file=sys.stderr, flush=True)


def run(name: str, task: Callable[[DictConfig], int | None]) -> NoReturn:
    """`python -m` entry: exit with main()'s status."""

    def process_task(cfg: DictConfig) -> int | None:
        skip_unused_imports(cfg)
        return task(cfg)

    exit_process(main(name, process_task))


def skip_unused_imports(cfg: DictConfig) -> None:
    """megatron-core imports wandb and peft imports bitsandbytes whenever they are installed; ftcore
    uses them only with logger.wandb.mode != disabled and peft=qlora. A process that needs neither
    leaves them out (an ImportError to those libraries, which then go without): seconds of import
    per process, and wandb's two temporary directories, which a killed process leaves in /tmp."""
    unused = []
    if OmegaConf.select(cfg, "logger.wandb.mode", default="disabled") == "disabled":
        unused.append("wandb")
    if OmegaConf.select(cfg, "peft.name", default="none") != "qlora":
        unused.append("bitsandbytes")
    for module in unused:
        sys.modules.setdefault(module, None)


def exit_process(status: int) -> NoReturn:
    """Exit with `status` as the interpreter does, less its teardown of every module (seconds for
    torch, megatron-core and transformers, which a finished run does not need). What that exit does
    for the run still happens, in its order: non-daemon threads are joined (after
    concurrent.futures' exit hooks), the atexit handlers run (logging.shutdown, multiprocessing's
    children, tempfile's finalizers, wandb), then Python's and C's output buffers are flushed.
    Under a profiler or tracer (cProfile, coverage, a debugger), which reports after the program
    returns, the process exits the usual way."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(status)
    threading._shutdown()  # what Py_Finalize calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # the C libraries' stdio buffers (exit() flushes them)
    except (OSError, AttributeError):
        pass
    os._exit(status)
