"""Data bigger than memory, measured: generate a large instruction JSONL, tokenize it through the
data pipeline on every rank of a node, and print the file size, token count, wall time and each
rank's peak resident memory. Run once by hand (not part of the test suite), e.g.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/data_scale_probe.py \
        --dir SCRATCH --gb 2.0

Rank 0 writes SCRATCH/data.jsonl (synthetic instruction records with long answers) and the
tokenization cache SCRATCH/cache/, built by ftcore.data.tokenized (local rank 0 tokenizes with a
pool of `--workers` processes while the other rank waits, then both memory-map the cache); then every rank builds its train loader and
assembles a few steps of packed micro-batches. Peak RSS (VmHWM) counts the cache pages a rank
touched too. `--keep` keeps the data; by default SCRATCH/data.jsonl and SCRATCH/cache/ are
deleted at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "time can more other about many them then some these two may first into only new could also "
    "after any like over such our most even made well should because each just those where how "
    "model data token memory stream cache number answer question training value result example"
).split()


def generate(path: Path, target_bytes: int, seed: int = 0) -> int:
    """Instruction records (a short question, a long answer) up to target_bytes; their number."""
    r = random.Random(seed)
    answers = [" ".join(r.choices(WORDS, k=r.randint(800, 1600))) for _ in range(256)]
    n, size = 0, 0
    with open(path, "w") as f:
        while size < target_bytes:
            rec = {
                "instruction": f"Question {n}: " + " ".join(r.choices(WORDS, k=r.randint(8, 40))),
                "output": answers[n % len(answers)],
            }
            line = json.dumps(rec) + "\n"
            f.write(line)
            size += len(line)
            n += 1
    return n


def mem() -> dict:
    from ftcore.runtime.host_memory import status

    return {k: status(k) for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="scratch directory for the data and the cache")
    ap.add_argument("--gb", type=float, default=1.0, help="size of the generated file, in 1e9 B")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="steps of micro-batches to assemble")
    ap.add_argument("--workers", type=int, default=0, help="data.tokenize_workers (0 = auto)")
    ap.add_argument("--keep", action="store_true", help="keep the generated data and cache")
    args = ap.parse_args()

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    scratch = Path(args.dir).expanduser()
    data, cache = scratch / "data.jsonl", scratch / "cache"
    if rank == 0:
        scratch.mkdir(parents=True, exist_ok=True)
        t = time.time()
        records = generate(data, int(args.gb * 1e9))
        print(f"generated {data.stat().st_size / 1e9:.3f} GB, {records} records in "
              f"{time.time() - t:.0f} s", flush=True)  # fmt: skip
    dist.barrier()

    from ftcore.config.schema import compose
    from ftcore.data.pipeline import build_train_loader
    from ftcore.data.tokenized import tokenize_source
    from ftcore.data.tokenizer import load_tokenizer
    from ftcore.runtime.host_memory import reset_peak

    cfg = compose([f"data.path={data}", f"data.cache_dir={cache}", f"data.seq_len={args.seq_len}",
                   "data.packing=true", f"train.global_batch_size={2 * world}",
                   "train.micro_batch_size=1", f"data.tokenize_workers={args.workers}"])  # fmt: skip
    tok = load_tokenizer(cfg)
    before = mem()
    reset_peak()
    t = time.time()
    src = tokenize_source(str(data), tok, cfg.data)
    tokenized_s = time.time() - t
    after_tokenize = mem()
    loader = build_train_loader(cfg, tok, rank, world)
    for _ in range(args.steps):
        loader.next_microbatches()
    end = mem()
    row = {
        "rank": rank,
        "file_bytes": data.stat().st_size,
        "documents": len(src),
        "tokens": int(src.offsets[-1]),
        "cache_bytes": sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()),
        "tokenize_wall_s": round(tokenized_s, 1),
        "total_wall_s": round(time.time() - t, 1),
        "rss_before_mb": round(before["VmRSS"] / 2**20, 1),
        "peak_rss_tokenize_mb": round(after_tokenize["VmHWM"] / 2**20, 1),
        "peak_rss_mb": round(end["VmHWM"] / 2**20, 1),
        "end_rss_anon_mb": round(end["RssAnon"] / 2**20, 1),
        "end_rss_file_mb": round(end["RssFile"] / 2**20, 1),
        # the largest tokenizing worker (render_pool.py), once the pool has exited
        "peak_rss_worker_mb": round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1
        ),
        "samples": loader.report["samples"],
        "rows": loader.report["rows"],
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
        if not args.keep:
            data.unlink()
            shutil.rmtree(cache, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("FTCORE_LOG_LEVEL", "WARNING")
    main()
