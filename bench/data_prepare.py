"""Data preparation: tokenization throughput per core against the `tokenizers` library's own batch
encoding of the same text, memory per worker, and the Processing-job projection for 30b-fp8 and 64b-fp8.

    .venv/bin/python bench/data_prepare.py [--mb 24] [--vocab 32000]

Text: this machine's Python standard library sources and the repository's docs (real, unique text; no
download), as JSONL files. Tokenizer: a byte-level BPE with --vocab ids trained here on part of it with
the `tokenizers` library (a hub tokenizer cannot be fetched; real ones of 128K ids run at other rates).

1. reference: `Tokenizer.encode_batch` over every document, with the library's own thread pool on
   every core (what a single-process script would do);
2. ours: `trainer.prepare.pipeline.prepare` on the same files, one worker process per core, writing shards
   (reading JSONL, hashing for the validation split, writing .bin/.idx, markers, indexes);
3. memory: the largest resident set of any worker (ru_maxrss of children), for inputs of 1x and 4x the
   size in ONE file: bounded means it does not grow with the file;
4. the planner's projection (trainstack.planner.data_prep) for the token budgets of 30b-fp8 and 64b-fp8.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training_image"))

from trainstack.planner.data_prep import MEASURED_TOKENS_PER_CORE_S, plan_for_tokens  # noqa: E402
from trainstack.recipes.loader import resolve  # noqa: E402


def corpus(limit_bytes: int) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
            total += len(text.encode())
        if total >= limit_bytes:
            break
    return texts


def train_tokenizer(texts: list[str], vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts[: max(1, len(texts) // 4)], trainer)
    tokenizer.save(str(path))


def write_jsonl(texts: list[str], directory: Path, files: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(directory / f"part-{f:03d}.jsonl", "w") as out:
            for text in texts[f::files]:
                out.write(json.dumps({"text": text, "meta": {"source": "stdlib"}}) + "\n")


def worker_rss_mib(args: list[str]) -> tuple[float, float, float]:
    """(seconds, peak RSS in MiB of the process that tokenized: a pool worker, or the process itself when
    one file leaves one worker) of a `python -m trainer.prepare` run."""
    probe = (
        "import resource, sys, time, runpy; sys.argv = ['prepare'] + sys.argv[1:]; t = time.time()\n"
        "from trainer.prepare.pipeline import main\n"
        "code = main(sys.argv[1:])\n"
        "usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]\n"
        "cpu = sum(u.ru_utime + u.ru_stime for u in usage)\n"
        "print('RESULT', time.time() - t, max(u.ru_maxrss for u in usage) / 1024, cpu, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'training_image'}:{ROOT}"}
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    line = next(x for x in done.stderr.splitlines() if x.startswith("RESULT"))
    _, seconds, rss, cpu = line.split()
    return float(seconds), float(rss), float(cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=24, help="MB of text for the throughput comparison")
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(
        f"machine: {platform.machine()}, {cores} cores, load average {os.getloadavg()[0]:.1f}, "
        f"Python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        texts = corpus(args.mb * 1_000_000)
        size = sum(len(t.encode()) for t in texts)
        started = time.perf_counter()
        train_tokenizer(texts, args.vocab, tmp / "tokenizer.json")
        print(
            f"text: {len(texts)} documents, {size / 1e6:.1f} MB; BPE of {args.vocab} ids trained in "
            f"{time.perf_counter() - started:.0f} s"
        )

        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        encode(texts[:50], add_special_tokens=False)  # warm the pool
        best = best_cpu = None
        for _ in range(2):
            started, cpu = time.perf_counter(), time.process_time()  # process time: every thread's CPU
            reference_tokens = sum(len(e.ids) for e in encode(texts, add_special_tokens=False))
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            best = seconds if best is None else min(best, seconds)
            best_cpu = cpu if best_cpu is None else min(best_cpu, cpu)
        reference = reference_tokens / best
        print(
            f"reference  tokenizers {encode.__name__} on {cores} threads: {reference_tokens:,} tokens in "
            f"{best:.2f} s wall = {reference / cores:,.0f} tokens/s per core; {best_cpu:.2f} CPU-s = "
            f"{reference_tokens / best_cpu:,.0f} tokens per CPU-second"
        )

        write_jsonl(texts, tmp / "in", files=4 * cores)
        common = ["--tokenizer", str(tmp / "tokenizer.json"), "--eos-token", "<|endoftext|>"]
        seconds, rss, cpu = worker_rss_mib(
            [str(tmp / "in"), *common, "--out", str(tmp / "out"), "--workers", str(cores)]
        )
        manifest = json.loads((tmp / "out" / "manifest.json").read_text())
        ours_tokens = (
            manifest["tokens"]
            + manifest["validation"]["tokens"]
            - manifest["documents"]
            - manifest["validation"]["documents"]
        )
        ours = ours_tokens / seconds
        print(
            f"ours       trainer.prepare, {cores} workers: {ours_tokens:,} tokens (+ end-of-document ids) in "
            f"{seconds:.2f} s wall (spawn, read, tokenize, write) = {ours / cores:,.0f} tokens/s per core; "
            f"{cpu:.2f} CPU-s = {ours_tokens / cpu:,.0f} tokens per CPU-second"
        )
        by_cpu = (ours_tokens / cpu) / (reference_tokens / best_cpu)
        print(
            f"ratio      ours / reference = {ours / reference:.2f} by wall time, {by_cpu:.2f} by CPU time "
            "(same text, tokenizer and cores)"
        )

        for factor in (1, 4):
            one = tmp / f"one-{factor}"
            one.mkdir()
            with open(one / "big.jsonl", "w") as out:
                for _ in range(factor):
                    for text in texts:
                        out.write(json.dumps({"text": text}) + "\n")
            file_mb = (one / "big.jsonl").stat().st_size / 1e6
            seconds, rss, _ = worker_rss_mib(
                [str(one), *common, "--out", str(tmp / f"o{factor}"), "--workers", "2"]
            )
            print(
                f"memory     one {file_mb:,.0f} MB JSONL file (one worker): peak RSS {rss:,.0f} MiB "
                f"({seconds:.1f} s)"
            )

    print(
        f"planner    assumes {MEASURED_TOKENS_PER_CORE_S:,.0f} tokens per core-second (x 0.6 per vCPU), "
        "range x0.5-x1.5"
    )
    for name in ("30b-fp8", "64b-fp8"):
        recipe = resolve(name).recipe
        budget = recipe.training.steps * recipe.tokens_per_step
        planned = plan_for_tokens(budget, "jsonl", file_gb=1.0)
        print(f"projection {name}: {budget / 1e9:,.0f}B tokens (the recipe's budget), JSONL in 1 GB files:")
        print(f"           {planned.describe()}")
    recipe = resolve("64b-fp8").recipe  # the recipe continues a pretraining; from scratch: ~20 per parameter
    budget = 20 * recipe.model.total_params
    print(f"projection 64b-fp8 from scratch, 20 tokens per parameter = {budget / 1e9:,.0f}B tokens:")
    print(f"           {plan_for_tokens(budget, 'jsonl', file_gb=1.0).describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
