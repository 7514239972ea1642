"""ftcore's per-node launcher: `python -m ftcore.launch.node [options] -- [Hydra overrides]`.

One runs on each node (one SLURM task per node, `srun --ntasks-per-node=1`, or the container of
each Kubeflow pod). It derives the rendezvous from SLURM's environment (ftcore.launch.slurm_env) or
Kubeflow's PET_* variables (ftcore.launch.pet_env), checks the allocation against the
experiment (so a wrong `--nodes` fails in seconds with exit 2, not after 128 processes started),
prints the resolved layout, starts one worker per GPU (or per requested CPU worker) with the
torchrun-style environment, and waits.

Why not torchrun: torchrun turns every worker failure into its own exit status 1, so the trainer's
"3 = stopped after saving, requeue me" would not reach the batch script, and on a signal it kills
the workers after a 30 s grace, too short to save a 70B/405B checkpoint. Here:
- SIGTERM/SIGINT/SIGUSR1 are forwarded to the workers, which save and exit 3 (SIGUSR2, submitit's
  warning, is sent on as SIGUSR1); the launcher waits for them as long as SLURM lets it;
- exit status: 0 if every worker finished; 3 if every worker exited 0 or 3 and one exited 3; else
  the first failure's status (128 + signal if killed). A failed worker (not 0/3) takes the others
  down (TERM, then KILL after --grace seconds), so a crash never hangs the other ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from ftcore.launch import pet_env, slurm_env

from ftcore.cli import VERBOSE_ENV, exit_process, quiet_libraries, skip_unused_imports
from ftcore.runtime import parent_death

EXIT_OK, EXIT_USER_ERROR, EXIT_REQUEUE = 0, 2, 3
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1 :]
    else:
        overrides = []
    p = argparse.ArgumentParser(
        prog="python -m ftcore.launch.node", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--nproc-per-node",
        default="auto",
        help="workers on this node: a number, or auto (GPUs SLURM gave the node, else "
        "cluster.gpus_per_node on GPU clusters, else launcher.nproc_per_node)",
    )
    p.add_argument("--module", default="ftcore.train", help="what each worker runs (python -m)")
    p.add_argument(
        "--grace", type=float, default=60.0, help="seconds between TERM and KILL after a crash"
    )
    p.add_argument(
        "--linger",
        type=float,
        default=10.0,
        help="seconds to stay after exit 2/3 on multi-node jobs (see finish())",
    )
    p.add_argument(
        "--no-check", action="store_true", help="skip the allocation-vs-experiment check"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the resolved layout as JSON, start nothing"
    )
    args, rest = p.parse_known_args(argv)
    return args, rest + overrides


def _compose(overrides: list[str]):
    from ftcore.config.schema import compose

    return compose(overrides)


def resolve_nproc(arg: str, cfg, env: dict[str, str]) -> int:
    if arg != "auto":
        return int(arg)
    if pet_env.nproc(env):  # a Kubeflow pod: the manifest's numProcPerNode, as torchrun reads it
        return pet_env.nproc(env)
    if cfg is not None and cfg.cluster.device == "cpu":
        return int(cfg.launcher.nproc_per_node)
    gpus = slurm_env.gpus_on_node(env)
    if gpus:
        return gpus
    return int(cfg.cluster.gpus_per_node) if cfg is not None else 1


def layout_of(env: dict[str, str], nproc: int, use_scontrol: bool) -> slurm_env.Layout:
    """This node's place in the job: from Kubeflow's PET_* variables in a pod, else SLURM's."""
    if pet_env.present(env):
        return pet_env.from_env(env, nproc)
    return slurm_env.from_env(env, nproc, use_scontrol=use_scontrol)


def check(layout: slurm_env.Layout, cfg) -> list[str]:
    """What is wrong with running `cfg` on this allocation; [] when it fits."""
    problems = []
    c, par = cfg.cluster, cfg.parallel
    exp = cfg.run.exp
    if c.device != "cpu" and c.num_gpus is not None and layout.world_size != c.num_gpus:
        problems.append(
            f"the job has {layout.nnodes} node(s) x {layout.nproc_per_node} GPU(s) = {layout.world_size} "
            f"workers but {exp} sets cluster.num_gpus={c.num_gpus} (= {c.num_gpus // max(1, c.gpus_per_node)} "
            f"node(s) x {c.gpus_per_node}); fix: sbatch --nodes={max(1, c.num_gpus // max(1, c.gpus_per_node))} "
            f"--gpus-per-node={c.gpus_per_node}, or pass cluster.num_gpus={layout.world_size}"
        )
    if c.device != "cpu" and layout.nproc_per_node != c.gpus_per_node:
        problems.append(
            f"{layout.nproc_per_node} worker(s) per node but cluster.gpus_per_node={c.gpus_per_node}; "
            f"fix: sbatch --gpus-per-node={c.gpus_per_node} or pass cluster.gpus_per_node="
            f"{layout.nproc_per_node}"
        )
    model_parallel = par.tp * par.pp * par.cp
    if layout.world_size % model_parallel:
        problems.append(
            f"{layout.world_size} workers do not divide into tp*pp*cp = {par.tp}*{par.pp}*{par.cp} "
            f"= {model_parallel}; fix: a multiple of {model_parallel} workers"
        )
    return problems


def job_problems(layout: slurm_env.Layout, cfg, module: str) -> list[str]:
    """What the workers' own checks would refuse (ftcore.validation.checks: paths, adapter and base weights,
    divisibility, the target cluster's hardware, memory fit, world size), found by the dry run on a
    login node instead of after the job waited in the queue."""
    from ftcore.errors import FtcoreError
    from ftcore.validation import checks, preflight

    training = module == "ftcore.train"
    try:
        preflight.use_adapter(cfg, training=training)
    except FtcoreError as e:
        return [str(e)]
    c = cfg.cluster
    # as many workers as the experiment asks for: a different allocation is check()'s problem
    launched = c.num_gpus if c.device != "cpu" and c.num_gpus is not None else layout.world_size
    return checks.problems(cfg, launched, training=training)


def describe(layout: slurm_env.Layout, cfg, module: str, overrides: list[str]) -> dict:
    d = layout.as_dict()
    d["worker_cmd"] = [sys.executable, "-m", module, *overrides]
    if cfg is not None:
        par = cfg.parallel
        d.update(
            exp=cfg.run.exp,
            run_dir=cfg.run.dir,
            device=cfg.cluster.device,
            cluster=cfg.cluster.name,
            cluster_num_gpus=cfg.cluster.num_gpus,
            cluster_gpus_per_node=cfg.cluster.gpus_per_node,
            tp=par.tp,
            pp=par.pp,
            cp=par.cp,
            vp=par.vp,
            dp=layout.world_size // max(1, par.tp * par.pp * par.cp),
        )
    return d


def _status(code: int) -> int:
    """Popen returncode -> shell-style status (128 + signal when killed)."""
    return 128 - code if code < 0 else code


def _ignore_usr2() -> None:
    """In each worker (inherited through exec): SLURM's `--signal=USR2` (submitit) reaches every
    process of the step, and USR2 would kill a worker; the launcher turns it into USR1 instead."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def start_workers(cmd: list[str], envs: list[dict[str, str]]) -> list[subprocess.Popen]:
    """One worker per environment. Each gets SIGTERM (save and stop) if this launcher dies
    without forwarding anything, e.g. SIGKILLed (ftcore/runtime/parent_death.py)."""
    preexec = parent_death.preexec(also=_ignore_usr2)
    return [subprocess.Popen(cmd, env=env, preexec_fn=preexec) for env in envs]


def supervise(procs: list[subprocess.Popen], grace: float) -> int:
    """Wait for every worker; forward stop signals; on a crash take the others down."""

    def forward(signum, _frame):
        # SIGUSR2 (submitit's "time is nearly up") becomes the trainer's stop request, SIGUSR1.
        to = signal.SIGUSR1 if signum == signal.SIGUSR2 else signal.Signals(signum)
        live = [p for p in procs if p.poll() is None]
        if live:
            name = signal.Signals(signum).name
            print(f"ftcore.launch: got {name}, sending {to.name} to the workers", flush=True)
        for p in live:
            p.send_signal(to)

    for s in FORWARDED:
        signal.signal(s, forward)
    failure = None
    kill_at = None
    while True:
        codes = [p.poll() for p in procs]
        bad = [(i, _status(c)) for i, c in enumerate(codes) if c is not None and c not in (0, 3)]
        if bad and failure is None:
            failure = bad[0][1]
            print(
                f"ftcore.launch: local worker {bad[0][0]} failed with status {failure}; "
                "stopping the others",
                file=sys.stderr,
                flush=True,
            )
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            kill_at = time.monotonic() + grace
        if all(c is not None for c in codes):
            break
        if kill_at is not None and time.monotonic() > kill_at:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            kill_at = None
        time.sleep(0.1)
    if failure is not None:
        return failure
    return EXIT_REQUEUE if any(p.returncode == EXIT_REQUEUE for p in procs) else EXIT_OK


def finish(
    status: int, nnodes: int, linger: float, exits: Path | None = None, node: int = 0
) -> int:
    """Return `status`, after lingering when other nodes may still be finishing.

    srun --kill-on-bad-exit stops the whole step as soon as one node's task exits non-zero: a node
    that reports 3 (saved, requeue me) or 2 (user error) a moment before the others would get their
    workers killed mid-exit and turn the job's status into 143. Every node lingers instead, so the
    others report the same status in their own time; a crash (any other status) ends at once.
    With `exits` (a directory every node sees: the run's logs/), each node leaves a file there and
    the linger ends once every node's is there (the whole linger where that directory is not
    shared, or its listing lags): nodes that stop together then end together at once.
    """
    # The workers are gone: a signal now has nothing to stop. Ignore it rather than let it kill us
    # while Python shuts down (which restores the default handlers, but keeps SIG_IGN), since the
    # nodes that linger together end together and srun's TERM would otherwise turn 2/3 into 143.
    for s in FORWARDED:
        signal.signal(s, signal.SIG_IGN)
    if nnodes > 1 and status in (EXIT_USER_ERROR, EXIT_REQUEUE):
        done = _mark_done(exits, node, status)
        end = time.monotonic() + linger
        while time.monotonic() < end and not done(nnodes):
            time.sleep(0.2)
    return status


def _mark_done(exits: Path | None, node: int, status: int):
    """Leave this node's file for this attempt of the job in `exits`/node_exits; return a test of
    whether `n` nodes have (always False without a usable directory)."""
    env = os.environ
    job, restart = env.get("SLURM_JOB_ID", "local"), env.get("SLURM_RESTART_COUNT", "0")
    attempt = f"{job}.{restart}.{env.get('SLURM_STEP_ID', '0')}"
    if exits is None:
        return lambda n: False
    where = exits / "node_exits"
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(where, 0o700)
        if not all(_mine(d) for d in (exits.parent, exits, where)):
            return lambda n: False  # someone else's directory (or a link): write nothing there
        # created anew, never through a name someone left there (a link to a file of theirs)
        fd = os.open(where / f"{attempt}.node{node}",
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)  # fmt: skip
        with os.fdopen(fd, "w") as f:
            f.write(f"{status}\n")
    except OSError:
        return lambda n: False
    return lambda n: len(list(where.glob(f"{attempt}.node*"))) >= n


def _mine(path: Path) -> bool:
    """A real directory (not a link) of this user's."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def exits_dir(overrides: list[str]) -> Path | None:
    """The run's logs/ (the job script makes it before the step): the last run.dir= given."""
    dirs = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("run.dir=")]
    return Path(dirs[-1]) / "logs" if dirs else None


def main(argv: list[str] | None = None) -> int:
    from ftcore.runtime import megatron_jit

    megatron_jit.install()  # the dry run's checks import megatron-core (as ftcore/cli.py does)
    quiet_libraries(os.environ.get(VERBOSE_ENV) == "1")  # FTCORE_VERBOSE=1 shows them
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.dry_run:
        args.linger = 0.0
    # Until the workers run, a signal (srun stopping the step because another node failed) is
    # only noted: every node then reports its own verdict, e.g. the same config error (2).
    early: list[int] = []
    for s in FORWARDED:
        signal.signal(s, lambda signum, _f: early.append(signum))
    env = dict(os.environ)
    cfg = None
    from ftcore.errors import FtcoreError

    if not args.no_check:
        try:
            cfg = _compose(overrides)
            skip_unused_imports(cfg)
        except FtcoreError as e:
            print(f"ftcore error: {e}", file=sys.stderr, flush=True)
            at = layout_of(env, 1, use_scontrol=False)
            return finish(
                EXIT_USER_ERROR, at.nnodes, args.linger, exits_dir(overrides), at.node_rank
            )
    nproc = resolve_nproc(args.nproc_per_node, cfg, env)
    try:
        layout = layout_of(env, nproc, use_scontrol=not args.dry_run)
    except FtcoreError as e:  # a PET_* environment ftcore cannot run in
        print(f"ftcore error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    info = describe(layout, cfg, args.module, overrides)
    exits = exits_dir(overrides)
    problems = check(layout, cfg) if cfg is not None else []
    if args.dry_run:
        problems += job_problems(layout, cfg, args.module) if cfg is not None else []
        print(json.dumps({**info, "problems": problems}))
        for p in problems:  # the JSON is for scripts; each problem on its own line for the user
            print(f"ftcore error: {p}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR if problems else EXIT_OK
    if problems:
        for p in problems:
            print(f"ftcore error: launch: {p}", file=sys.stderr, flush=True)
        return finish(EXIT_USER_ERROR, layout.nnodes, args.linger, exits, layout.node_rank)
    if layout.node_rank == 0:
        keys = ("exp", "nnodes", "nproc_per_node", "world_size", "tp", "pp", "cp", "dp")
        summary = " ".join(f"{k}={info[k]}" for k in keys if k in info)
        print(f"ftcore.launch: job {layout.job_id}: {summary}", flush=True)
        # the address, not the port: logs outlive the job and the port is the store's only secret
        print(
            f"ftcore.launch: rendezvous at {layout.master_addr} nodes={','.join(layout.nodes)}",
            flush=True,
        )
        print(f"ftcore.launch: worker command: {' '.join(info['worker_cmd'])}", flush=True)
    if early:
        print(f"ftcore.launch: got {signal.Signals(early[0]).name} before start", file=sys.stderr)
        return 128 + early[0]
    gpu = cfg is None or cfg.cluster.device != "cpu"
    envs = [slurm_env.worker_env(layout, r, env, gpu, cfg) for r in range(layout.nproc_per_node)]
    procs = start_workers(info["worker_cmd"], envs)
    status = supervise(procs, args.grace)
    print(f"ftcore.launch: node {layout.node_rank}: workers done, exit {status}", flush=True)
    return finish(status, layout.nnodes, args.linger, exits, layout.node_rank)


if __name__ == "__main__":
    exit_process(main())
