"""What the checkpoint digests cost: SHA-256 throughput, and a DCP save with and without hashing.

    python bench/checkpoint_digest.py                 # CPU, 256 MiB of FP32 tensors, local disk
    python bench/checkpoint_digest.py --mib 1024      # larger

1. hashlib's SHA-256 on 1, 2 and 4 threads at once (hashlib releases the GIL on large buffers, as on
   the 4 DCP writer threads of an S3 save): GiB/s per thread and in all.
2. `dcp.save` of a state dict of that size to a local directory through torch's FileSystemWriter,
   plain and with its file system wrapped by trainer.checkpoint.integrity.DigestingWrites (what every save
   does): best of 3 each, and the digests checked against hashlib reading the files back.
Record results in docs/benchmarks.md (## Checkpoint integrity).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "training_image"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from trainer.checkpoint.integrity import DigestingWrites  # noqa: E402


def hash_rate(threads: int, mib: int = 256) -> float:
    """GiB/s of SHA-256 over all `threads` threads, each hashing its own `mib` MiB buffer."""
    buffers = [os.urandom(mib * 2**20) for _ in range(threads)]
    workers = [threading.Thread(target=hashlib.sha256, args=(b,)) for b in buffers]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return threads * mib / 1024 / (time.perf_counter() - start)


def save_seconds(state: dict, directory: Path, digested: bool) -> tuple[float, dict]:
    writer = FileSystemWriter(directory)
    wrapper = None
    if digested:
        wrapper = DigestingWrites(writer.fs, step=1, rank=0)
        writer.fs = wrapper
    start = time.perf_counter()
    dcp.save(state, storage_writer=writer)
    return time.perf_counter() - start, (wrapper.written if wrapper else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    rates = {threads: hash_rate(threads) for threads in (1, 2, 4)}
    tensors = max(1, args.mib // 16)
    state = {f"t{i}": torch.randn(4 * 2**20) for i in range(tensors)}  # 16 MiB each
    plain, hashed, written = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(3):
            plain.append(save_seconds(state, Path(tmp) / f"plain{attempt}", False)[0])
            seconds, written = save_seconds(state, Path(tmp) / f"hashed{attempt}", True)
            hashed.append(seconds)
        folder = Path(tmp) / "hashed2"
        for name, record in written.items():
            assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == record.sha256, name
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
                "sha256_gib_per_s": {f"{t} thread(s)": round(r, 2) for t, r in rates.items()},
                "saved_mib": tensors * 16,
                "dcp_save_s_plain_best_of_3": round(min(plain), 3),
                "dcp_save_s_digested_best_of_3": round(min(hashed), 3),
                "digests_match_hashlib_reading_back": len(written),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
