"""Data preparation: `data prepare`'s tokenization per CPU-second beside its peers on the same files, in one
run: a plain `tokenizers` script (the baseline) and datatrove's DocumentTokenizer (where it is installed),
at 1 and 2 worker processes; peak memory per process; the Processing-job projection for 30b/64b-fp8.

    .venv/bin/python bench/data_prepare.py [--mb 12] [--vocab 32000] [--workers 1 2] [--repeat 2]

Text: this machine's Python standard library sources and the repository's docs (real, unique text; no
download), as JSONL files (4 per worker setting's largest count, so every worker has files). Tokenizer: a
byte-level BPE with --vocab ids trained here on part of it with the `tokenizers` library (a hub tokenizer
cannot be fetched; real ones of 128K ids run at other rates).

Engines, each run as its own process tree (what a user runs, start-up included), CPU time = user + system
of every process of the tree (getrusage of the children), tokens = document tokens (end-of-document ids
not counted):

1. ours: `python -m trainer.prepare FILES --workers N --validation-fraction 0` (reading JSONL, hashing
   for the split, writing .bin/.idx, markers, indexes);
2. baseline: the plain script a user would write: a pool of N processes, each loading the tokenizer and,
   per file, `json.loads` per line, `Tokenizer.encode_batch_fast` per 256 documents, the ids with an
   end-of-document id as uint16 to one .bin per file (numpy);
3. datatrove: `LocalPipelineExecutor([JsonlReader, DocumentTokenizer(shuffle_documents=False)], tasks=N,
   workers=N)` (pip install datatrove orjson; optional, never a project dependency).

Verified in the run: ours and the baseline write byte-identical .bin files per input file; datatrove's
documents are the same id sequences (compared as a multiset of documents: it orders files by task).
Peak memory: the largest VmHWM / ru_maxrss of any process of the tree (a pool worker, or the process
itself at 1 worker), for the throughput inputs and for ONE file 4x their size (bounded: it must not grow).
CPU time on a shared machine is still noisy: each engine runs --repeat times, interleaved; the ratio of the
best runs and the ratio of the medians are both printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training_image"))

EOS = "<|endoftext|>"
BASELINE_BATCH = 256


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
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts[: max(1, len(texts) // 4)], trainer)
    tokenizer.save(str(path))


def write_jsonl(texts: list[str], directory: Path, files: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(directory / f"part-{f:03d}.jsonl", "w") as out:
            for text in texts[f::files]:
                out.write(json.dumps({"text": text, "meta": {"source": "stdlib"}}) + "\n")


# --- the engines, each run in a child process tree (`--engine`) -------------------------------------


def _baseline_file(args: tuple[str, str, str]) -> int:
    """One input file through the plain script: returns its document tokens."""
    import numpy as np
    from tokenizers import Tokenizer

    source, tokenizer_path, out = args
    global _TOKENIZER
    if "_TOKENIZER" not in globals():
        _TOKENIZER = Tokenizer.from_file(tokenizer_path)
    eos = _TOKENIZER.token_to_id(EOS)
    tokens = 0
    with open(source, "rb") as lines, open(Path(out) / (Path(source).stem + ".bin"), "wb") as sink:
        batch: list[str] = []
        for line in [*lines, None]:
            if line is not None and line.strip():
                batch.append(json.loads(line)["text"])
            if batch and (line is None or len(batch) == BASELINE_BATCH):
                for encoding in _TOKENIZER.encode_batch_fast(batch, add_special_tokens=False):
                    ids = encoding.ids
                    tokens += len(ids)
                    sink.write(np.array([*ids, eos], dtype=np.uint16).tobytes())
                batch = []
    return tokens


def run_engine(engine: str, workers: int, inputs: Path, tokenizer: Path, out: Path) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process, in every engine
    files = sorted(str(p) for p in inputs.glob("*.jsonl"))
    if engine == "ours":
        from trainer.prepare.pipeline import main

        args = [str(inputs), "--tokenizer", str(tokenizer), "--eos-token", EOS, "--out", str(out)]
        code = main([*args, "--workers", str(workers), "--validation-fraction", "0"])
        if code:
            raise SystemExit(code)
    elif engine == "baseline":
        out.mkdir(parents=True)
        jobs = [(f, str(tokenizer), str(out)) for f in files]
        if workers == 1:
            list(map(_baseline_file, jobs))
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                list(pool.map(_baseline_file, jobs))
    else:
        from datatrove.executor import LocalPipelineExecutor
        from datatrove.pipeline.readers import JsonlReader
        from datatrove.pipeline.tokens import DocumentTokenizer

        pipeline = [
            JsonlReader(str(inputs), glob_pattern="*.jsonl"),
            DocumentTokenizer(
                str(out), tokenizer_name_or_path=str(tokenizer), eos_token=EOS, shuffle_documents=False
            ),
        ]
        LocalPipelineExecutor(
            pipeline,
            tasks=workers,
            workers=workers,
            logging_dir=str(out / "logs"),
            skip_completed=False,
            start_method="spawn",  # its default, forkserver, would hide the workers from our rusage
        ).run()
    own = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) // 1024
    import resource

    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(u.ru_utime + u.ru_stime for u in usage)
    # Children: ru_maxrss (Linux keeps it across exec; a spawned worker starts from this small process).
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    print("RESULT", json.dumps({"cpu": cpu, "peak_mib": max(own, children)}))


def measure(engine: str, workers: int, inputs: Path, tokenizer: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'training_image'}:{ROOT}"}
    command = [sys.executable, __file__, "--engine", engine, "--workers", str(workers)]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "--inputs", str(inputs), "--tokenizer", str(tokenizer), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{engine}: {done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[len("RESULT ") :]), "wall": wall}


# --- reading the outputs back ----------------------------------------------------------------------


def documents_of(stream, eos: int) -> Counter:
    import numpy as np

    bounds = np.flatnonzero(stream == eos)
    starts = np.r_[0, bounds[:-1] + 1]
    return Counter(stream[a:b].tobytes() for a, b in zip(starts, bounds, strict=True))


def verify(outputs: dict[str, Path], inputs: Path, eos: int) -> tuple[int, str]:
    """Document tokens of the run, after checking the engines wrote the same ids."""
    import numpy as np

    ours_root, base_root = outputs["ours"], outputs["baseline"]
    index = json.loads((ours_root / "index.json").read_text())
    by_input: dict[str, list[str]] = {}
    for path in sorted((ours_root / "_prepare" / "done").glob("*.json")):
        marker = json.loads(path.read_text())
        by_input[Path(marker["uri"]).stem] = [e["file"] for e in marker["shards"]["train"]]
    for stem, shard_files in sorted(by_input.items()):
        ours = b"".join((ours_root / f).read_bytes() for f in shard_files)
        if ours != (base_root / f"{stem}.bin").read_bytes():
            raise SystemExit(f"ids differ: ours and the baseline on {stem}.jsonl")
    stream = np.concatenate([np.fromfile(ours_root / e["file"], dtype=np.uint16) for e in index["shards"]])
    tokens = int(stream.size - np.count_nonzero(stream == eos))
    checked = "ours == baseline (byte-identical .bin per input file)"
    if "datatrove" in outputs:
        theirs = np.concatenate(
            [np.fromfile(p, dtype=np.uint16) for p in sorted(outputs["datatrove"].glob("*.ds"))]
        )
        if documents_of(theirs, eos) != documents_of(stream, eos):
            raise SystemExit("ids differ: ours and datatrove (as a multiset of documents)")
        checked += " == datatrove (the same documents' ids)"
    return tokens, checked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=12, help="MB of text for the throughput comparison")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each engine, interleaved (best and median shown)"
    )
    parser.add_argument("--skip-memory", action="store_true", help="no 1x/4x one-file memory runs")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        run_engine(args.engine, args.workers[0], args.inputs, args.tokenizer, args.out)
        return 0
    try:
        import datatrove  # noqa: F401
        import orjson  # noqa: F401  (datatrove's JsonlReader needs it)

        engines = ["ours", "baseline", "datatrove"]
    except ImportError:
        engines = ["ours", "baseline"]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
        f"Python {platform.python_version()}; engines: {', '.join(engines)}"
        + ("" if "datatrove" in engines else " (datatrove not installed: pip install datatrove orjson)")
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        texts = corpus(args.mb * 1_000_000)
        size = sum(len(t.encode()) for t in texts)
        started = time.perf_counter()
        tokenizer = tmp / "tokenizer.json"
        train_tokenizer(texts, args.vocab, tokenizer)
        from tokenizers import Tokenizer

        eos = Tokenizer.from_file(str(tokenizer)).token_to_id(EOS)
        print(
            f"text: {len(texts)} documents, {size / 1e6:.1f} MB; BPE of {args.vocab} ids trained in "
            f"{time.perf_counter() - started:.0f} s"
        )
        write_jsonl(texts, tmp / "in", files=4 * max(args.workers))
        for workers in args.workers:
            best: dict[str, dict] = {}
            every: dict[str, list[float]] = {e: [] for e in engines}
            for _ in range(args.repeat):
                for engine in engines:  # interleaved: a load spike hits every engine alike
                    result = measure(engine, workers, tmp / "in", tokenizer, tmp / engine)
                    every[engine].append(result["cpu"])
                    print(
                        f"  ({workers} worker(s), {engine}: {result['cpu']:.2f} CPU-s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    if engine not in best or result["cpu"] < best[engine]["cpu"]:
                        best[engine] = result
                tokens, checked = verify({e: tmp / e for e in engines}, tmp / "in", eos)
            rate = {e: tokens / best[e]["cpu"] for e in engines}
            median = {e: tokens / sorted(every[e])[len(every[e]) // 2] for e in engines}
            print(f"{workers} worker(s): {tokens:,} tokens; ids verified: {checked}")
            for engine in engines:
                got = best[engine]
                print(
                    f"  {engine:<9} {got['cpu']:6.2f} CPU-s = {rate[engine]:>9,.0f} tokens per CPU-second"
                    f" ({got['wall']:5.1f} s wall); peak {got['peak_mib']:4.0f} MiB per process"
                )
            ratios = ", ".join(f"{rate['ours'] / rate[e]:.2f}x {e}" for e in engines if e != "ours")
            medians = ", ".join(f"{median['ours'] / median[e]:.2f}x {e}" for e in engines if e != "ours")
            print(
                f"  ratio     ours per CPU-second = {ratios} (best runs); "
                f"{medians} (medians of {args.repeat})"
            )

        if not args.skip_memory:
            for factor in (1, 4):
                one = tmp / f"one-{factor}"
                one.mkdir()
                with open(one / "big.jsonl", "w") as out:
                    for _ in range(factor):
                        for text in texts:
                            out.write(json.dumps({"text": text}) + "\n")
                file_mb = (one / "big.jsonl").stat().st_size / 1e6
                peaks = {e: measure(e, 1, one, tokenizer, tmp / f"m-{e}")["peak_mib"] for e in engines}
                shown = ", ".join(f"{e} {p:,.0f} MiB" for e, p in peaks.items())
                print(f"memory    one {file_mb:,.0f} MB JSONL file, 1 worker: peak {shown}")

    from trainstack.planner.data_prep import MEASURED_TOKENS_PER_CORE_S, plan_for_tokens
    from trainstack.recipes.loader import resolve

    print(
        f"planner   assumes {MEASURED_TOKENS_PER_CORE_S:,.0f} tokens per core-second (x 0.6 per vCPU), "
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
