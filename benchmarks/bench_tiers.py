"""Disk-tier benchmarks, every contender measured side by side in one run.

1. Store and load N chunks of 256 KiB, 2 MiB and 8 MiB: our DiskIndex + SlabFile path
   (allocate/write/commit, lookup/read/verify) against raw sequential file I/O of the same
   bytes in the same directory, vLLM's own filesystem tier I/O
   (``vllm.v1.kv_offload.tiering.fs.io.batch_store_block`` / ``batch_load_block``) and
   the rejected alternative design: chunks stored as LMDB values.
2. Checksum speed on the same bytes (xxh3_64, crc32, ...).
3. Scheduler lookup cost per key with 10k, 100k and 1M keys in the index.

Reads are reported warm (page cache) and cold: after fsync, each contender's own files
are evicted from the page cache with POSIX_FADV_DONTNEED, which works unprivileged and
leaves other processes' cache alone (--drop-caches also tries the global
/proc/sys/vm/drop_caches once and reports the outcome). Writes are reported into the page
cache, and including the fsync that makes them durable.

    python benchmarks/bench_tiers.py --quick --json /tmp/tiers.json   # seconds
    python benchmarks/bench_tiers.py --json tiers.json                # ~2-3 min, 2 cores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import lmdb
import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_offload.checksum import checksum  # noqa: E402
from kv_offload.disk import DiskIndex, SlabFile  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BATCH = 8  # chunks per allocate/commit and per vLLM batch call


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes for a smoke test")
    parser.add_argument("--json", type=Path, help="write all results to this JSON file")
    parser.add_argument("--dir", type=Path, default=None,
                        help="directory to benchmark in (default: a temp dir under $TMPDIR)")
    parser.add_argument("--total-mib", type=int, default=None,
                        help="bytes stored per chunk size (default 256, --quick 8)")
    parser.add_argument("--lookup-keys", type=str, default=None,
                        help="comma-separated index sizes (default 10000,100000,1000000)")
    parser.add_argument("--threads", type=int, default=4,
                        help="I/O threads for the 'ours, N threads' row (default 4)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="runs per I/O contender, best kept (default 5, --quick 1)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="also drop the whole page cache once at start (root only)")
    args = parser.parse_args(argv)
    args.total_mib = args.total_mib or (8 if args.quick else 256)
    sizes = args.lookup_keys or ("1000,10000" if args.quick else "10000,100000,1000000")
    args.lookup_keys = [int(x) for x in sizes.split(",")]
    args.repeat = args.repeat or (1 if args.quick else 5)
    return args


# -- helpers -------------------------------------------------------------------------


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-faulted byte array (O_DIRECT needs alignment)."""
    arr = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    arr[:] = 1
    return arr


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fsync_files(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict_from_cache(paths) -> None:
    """Drop clean pages of ``paths`` from the page cache (fsync first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def try_drop_caches(wanted: bool) -> str:
    if not wanted:
        return "cold reads: per-file POSIX_FADV_DONTNEED"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches worked"
    except OSError as exc:
        return f"drop_caches refused ({exc.strerror}); cold reads use POSIX_FADV_DONTNEED"


def chunk_views(buf: np.ndarray, chunk: int) -> list[memoryview]:
    view = memoryview(buf)
    return [view[i : i + chunk] for i in range(0, buf.nbytes, chunk)]


# -- I/O contenders: each returns {"write", "write_sync", "read_warm", "read_cold"} seconds --


def run_ours(root: Path, src: np.ndarray, dst: np.ndarray, chunk: int, threads: int,
             verify: bool = True) -> dict:
    """Store then load every chunk through DiskIndex + SlabFile, as the tier does it.

    Returns the times of the whole path and, under "slab", of the SlabFile calls alone
    (the worker's part: the index runs in vLLM's scheduler process, not in the I/O path;
    with more than one thread the slab time is the wall time of the parallel calls).
    ``verify=False`` reads without checksum verification (what checksums cost)."""
    srcs, dsts = chunk_views(src, chunk), chunk_views(dst, chunk)
    keys = [hashlib.sha256(b"chunk-%d" % i).digest() for i in range(len(srcs))]
    ns = f"be0c{chunk:x}"
    index = DiskIndex.open(root, namespace_id=ns, descriptor={"bench": chunk}, slot_bytes=chunk,
                           num_ranks=1, capacity_bytes=src.nbytes)
    slab = SlabFile(root, namespace_id=ns, rank=0, num_ranks=1, slot_bytes=chunk)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    mapper = pool.map if pool else map
    slab_s = {"t": 0.0}

    def write(slot: int, i: int) -> int:
        return slab.write(slot, srcs[i])

    def read(entry, i: int) -> bool:
        return bool(slab.read(entry.slot, dsts[i], entry.checksums[0] if verify else None))

    def slab_part(fn, *columns) -> list:
        start = time.perf_counter()
        out = list(mapper(fn, *columns))
        slab_s["t"] += time.perf_counter() - start
        return out

    def store() -> None:
        for b in range(0, len(keys), BATCH):
            batch = keys[b : b + BATCH]
            slots = index.allocate(batch)
            sums = slab_part(write, slots, range(b, b + len(batch)))
            index.commit([(k, s, (c,)) for k, s, c in zip(batch, slots, sums)])

    def load() -> None:
        for b in range(0, len(keys), BATCH):
            entries = index.find_prefix(keys[b : b + BATCH])
            index.pin([e.slot for e in entries])
            ok = slab_part(read, entries, range(b, b + len(entries)))
            index.unpin([e.slot for e in entries])
            if len(entries) != len(keys[b : b + BATCH]) or not all(ok):
                raise RuntimeError("ours: a chunk failed to load")

    def phase(fn) -> tuple[float, float]:
        slab_s["t"] = 0.0
        total = timed(fn)
        return total, slab_s["t"]

    files = [slab.path, *sorted((root / "index").glob("*.mdb"))]
    out: dict = {"slab": {}}
    out["write"], out["slab"]["write"] = phase(store)
    sync = timed(lambda: fsync_files(files))
    out["write_sync"], out["slab"]["write_sync"] = out["write"] + sync, out["slab"]["write"] + sync
    out["read_warm"], out["slab"]["read_warm"] = phase(load)
    evict_from_cache(files)
    out["read_cold"], out["slab"]["read_cold"] = phase(load)
    index.close()
    slab.close()
    if pool:
        pool.shutdown()
    return out


def run_raw(root: Path, src: np.ndarray, dst: np.ndarray, chunk: int, threads: int = 1) -> dict:
    """One plain file, no checksum: sequential ``os.write`` / ``os.readv`` of each chunk,
    or with ``threads`` > 1 positional I/O of the chunks from a thread pool (the same
    concurrency as ours with that many I/O threads)."""
    path = root / "raw.bin"
    srcs, dsts = chunk_views(src, chunk), chunk_views(dst, chunk)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def store() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if pool:
            list(pool.map(lambda i: os.pwritev(fd, [srcs[i]], i * chunk), range(len(srcs))))
        else:
            for view in srcs:
                os.write(fd, view)
        os.close(fd)

    def load() -> None:
        fd = os.open(path, os.O_RDONLY)
        if pool:
            list(pool.map(lambda i: os.preadv(fd, [dsts[i]], i * chunk), range(len(dsts))))
        else:
            for view in dsts:
                os.readv(fd, [view])
        os.close(fd)

    out = {"write": timed(store)}
    out["write_sync"] = out["write"] + timed(lambda: fsync_files([path]))
    out["read_warm"] = timed(load)
    evict_from_cache([path])
    out["read_cold"] = timed(load)
    if pool:
        pool.shutdown()
    return out


def run_vllm(root: Path, src: np.ndarray, dst: np.ndarray, chunk: int, o_direct: bool) -> dict:
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    if o_direct and not fs_io.probe_o_direct(str(root)):
        raise RuntimeError(f"O_DIRECT is not supported in {root}")
    paths = [str(root / "vllm" / f"{i // 256:03d}" / f"{i:06d}.kv")
             for i in range(src.nbytes // chunk)]
    offsets = [i * chunk for i in range(len(paths))]
    src_view, dst_view = memoryview(src), memoryview(dst)

    def store() -> None:
        for b in range(0, len(paths), BATCH):
            fs_io.batch_store_block(paths[b : b + BATCH], src_view, offsets[b : b + BATCH], chunk,
                                    use_o_direct=o_direct)

    def load() -> None:
        for b in range(0, len(paths), BATCH):
            fs_io.batch_load_block(paths[b : b + BATCH], dst_view, offsets[b : b + BATCH], chunk,
                                   use_o_direct=o_direct)

    out = {"write": timed(store)}
    out["write_sync"] = out["write"] + timed(lambda: fsync_files(paths))
    out["read_warm"] = timed(load)
    evict_from_cache(paths)
    out["read_cold"] = timed(load)
    return out


def run_lmdb_values(root: Path, src: np.ndarray, dst: np.ndarray, chunk: int) -> dict:
    """The alternative design: each chunk an LMDB value (same sync policy as our index;
    readahead on, which suits large values)."""
    path, srcs, dsts = root / "lmdbvals", chunk_views(src, chunk), chunk_views(dst, chunk)
    keys = [hashlib.sha256(b"chunk-%d" % i).digest() for i in range(len(srcs))]
    sums: dict[bytes, int] = {}

    def open_env() -> lmdb.Environment:
        return lmdb.open(str(path), map_size=2 * src.nbytes + 64 * MiB, sync=False, metasync=False,
                         readahead=True, meminit=False)

    env = open_env()

    def store() -> None:
        for b in range(0, len(keys), BATCH):
            with env.begin(write=True) as txn:
                for i in range(b, min(b + BATCH, len(keys))):
                    sums[keys[i]] = checksum(srcs[i])
                    txn.put(keys[i], srcs[i])

    def load() -> None:
        with env.begin(buffers=True) as txn:
            for i, key in enumerate(keys):
                value = txn.get(key)
                dsts[i][:] = value
                if checksum(dsts[i]) != sums[key]:
                    raise RuntimeError("lmdb values: checksum mismatch")

    out = {"write": timed(store)}
    out["write_sync"] = out["write"] + timed(lambda: env.sync(True))
    out["read_warm"] = timed(load)
    env.close()
    evict_from_cache([path / "data.mdb"])
    env = open_env()
    out["read_cold"] = timed(load)
    env.close()
    return out


def bench_io(args: argparse.Namespace, base: Path) -> list[dict]:
    rows = []
    total = args.total_mib * MiB
    src = aligned(total)
    src[:] = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = aligned(total)
    memcpy = min(timed(lambda: np.copyto(dst, src)) for _ in range(3))
    rows.append({"chunk": 0, "contender": "memcpy (numpy)", "write": memcpy, "write_sync": memcpy,
                 "read_warm": memcpy, "read_cold": memcpy, "bytes": total})
    contenders: dict[str, Callable[[Path, int], dict]] = {
        "raw sequential file": lambda d, c: run_raw(d, src, dst, c),
        f"raw file ({args.threads} threads)": lambda d, c: run_raw(d, src, dst, c, args.threads),
        "ours (1 thread)": lambda d, c: run_ours(d, src, dst, c, 1),
        "ours, no verify (1 thread)": lambda d, c: run_ours(d, src, dst, c, 1, verify=False),
        f"ours ({args.threads} threads)": lambda d, c: run_ours(d, src, dst, c, args.threads),
        "vllm fs io (O_DIRECT)": lambda d, c: run_vllm(d, src, dst, c, True),
        "vllm fs io (buffered)": lambda d, c: run_vllm(d, src, dst, c, False),
        "lmdb values": lambda d, c: run_lmdb_values(d, src, dst, c),
    }
    for chunk in (256 * KiB, 2 * MiB, 8 * MiB):
        best: dict[str, dict] = {}
        errors: dict[str, str] = {}
        for r in range(args.repeat):  # rotating order, so that load spikes hit everyone alike
            names = list(contenders)
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name in errors:
                    continue
                work = Path(tempfile.mkdtemp(dir=base))
                dst[:] = 0
                try:
                    times = contenders[name](work, chunk)
                    if not np.array_equal(dst, src):
                        raise RuntimeError("loaded bytes differ from the stored bytes")
                except Exception as exc:  # report, do not hide (e.g. vLLM's I/O cannot run)
                    errors[name] = f"{type(exc).__name__}: {exc}"
                    continue
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                for label, result in _split_slab(name, times).items():
                    old = best.get(label, result)
                    best[label] = {phase: min(t, old[phase]) for phase, t in result.items()}
        for name in dict.fromkeys(n for c in contenders for n in (_slab_label(c), c)):
            if name in errors:
                rows.append({"chunk": chunk, "contender": name, "error": errors[name]})
            elif name in best:
                rows.append({"chunk": chunk, "contender": name, "bytes": total, **best[name]})
    for row in rows:
        for phase in ("write", "write_sync", "read_warm", "read_cold"):
            if phase in row:
                row[phase + "_gbps"] = round(row["bytes"] / row.pop(phase) / 1e9, 3)
    return rows


def _slab_label(name: str) -> str:
    return name.replace("ours", "ours: slab only", 1) if name.startswith("ours") else name


def _split_slab(name: str, times: dict) -> dict[str, dict]:
    """A contender's rows: ours gives its whole path and its slab part."""
    times = dict(times)
    slab = times.pop("slab", None)
    return {name: times, **({_slab_label(name): slab} if slab else {})}


RATIO_PAIRS = (  # (ours, baseline, graded against a target) per chunk size
    ("ours: slab only (1 thread)", "raw sequential file", True),
    ("ours (1 thread)", "raw sequential file", False),
    ("ours: slab only, no verify (1 thread)", "raw sequential file", False),
    ("ours: slab only (1 thread)", "ours: slab only, no verify (1 thread)", False),
    ("ours (1 thread)", "vllm fs io (O_DIRECT)", True),
    ("ours (1 thread)", "vllm fs io (buffered)", True),
    ("ours (1 thread)", "lmdb values", False),
)


def io_ratios(rows: list[dict], threads: int) -> list[dict]:
    """Ours / baseline per chunk size and phase (``RATIO_PAIRS``). The targets apply to
    the slab row vs the raw file (the worker's I/O, checksums included) and to the whole
    path vs vLLM's fs tier; the rest is for the record (index cost, checksum cost)."""
    by = {(r["chunk"], r["contender"]): r for r in rows if "error" not in r}
    out = []
    pairs = (*RATIO_PAIRS, (f"ours: slab only ({threads} threads)",
                            f"raw file ({threads} threads)", False))
    for chunk in sorted({r["chunk"] for r in rows if r["chunk"]}):
        for ours_name, other, graded in pairs:
            ours, ref = by.get((chunk, ours_name)), by.get((chunk, other))
            if ours and ref:
                vs = other if ours_name == "ours (1 thread)" else f"{other} [{ours_name}]"
                out.append({"chunk": chunk, "ours": ours_name, "vs": vs, "graded": graded, **{
                    p: round(ours[p + "_gbps"] / ref[p + "_gbps"], 2)
                    for p in ("write", "write_sync", "read_warm", "read_cold")}})
    return out


def notes(result: dict) -> list[str]:
    """The prose of the report section, with this run's numbers."""
    ratios = result.get("io_ratios", [])

    def span(ours: str, vs: str, phase: str) -> str:
        sel = [r[phase] for r in ratios if r["ours"] == ours and r["vs"].startswith(vs)]
        return f"{min(sel):.2f}-{max(sel):.2f}x" if sel else "n/a"

    slab = "ours: slab only (1 thread)"
    threads = result.get("threads", "?")
    slab_n = f"ours: slab only ({threads} threads)"
    xxh = [r["gbps"] for r in result.get("checksums", []) if r["algorithm"] == "xxh3_64"]
    load = (result["machine"]["loadavg_start"][0], result["machine"]["loadavg_end"][0])
    return [
        "**What is compared.** *ours: slab only* times the `SlabFile.write` / `read` calls "
        "(what a worker's I/O thread does: positional I/O between a host slot and the slab, "
        "xxh3_64 of every byte, verified on read); *ours* adds the `DiskIndex` calls "
        "(allocate/commit, find_prefix/pin/unpin per batch of 8), which run in vLLM's "
        "scheduler process in the connector, not in the I/O path. *raw sequential file*: "
        "`os.write` / `os.readv` of the same chunks into one fresh file, no checksum. Cold "
        "reads: each contender's files are fsync'ed, then dropped from the page cache with "
        "`posix_fadvise(POSIX_FADV_DONTNEED)` (unprivileged, other processes' cache "
        "untouched). Contenders run in rotating order, fresh directories each run, the "
        f"best of {result.get('repeat', '?')} runs per phase kept. Load average "
        f"{load[0]:.1f} -> {load[1]:.1f} (1 min) during the run.",
        "**This run.** Slab vs raw file: warm reads "
        f"{span(slab, 'raw', 'read_warm')}, cold reads {span(slab, 'raw', 'read_cold')}, "
        f"writes {span(slab, 'raw', 'write')} (with fsync {span(slab, 'raw', 'write_sync')}). "
        f"The whole path (index included) vs raw: warm reads "
        f"{span('ours (1 thread)', 'raw', 'read_warm')}, writes "
        f"{span('ours (1 thread)', 'raw', 'write')}. With {threads} I/O threads on both "
        f"sides (slab vs raw file): warm reads {span(slab_n, 'raw file', 'read_warm')}, cold "
        f"{span(slab_n, 'raw file', 'read_cold')}, writes {span(slab_n, 'raw file', 'write')}.",
        "**What checksums cost.** Verified / unverified slab reads: warm "
        f"{span(slab, 'ours: slab only, no verify', 'read_warm')}, cold "
        f"{span(slab, 'ours: slab only, no verify', 'read_cold')}. xxh3_64 hashes "
        f"{'/'.join(f'{x:.0f}' for x in xxh) or '?'} GB/s (256 KiB / 8 MiB) and holds the "
        "GIL; a page-cache read copies ~10-12 GB/s, so hashing the bytes after the kernel "
        "copied them adds ~20% to a warm read on one thread: one thread cannot reach 0.9x "
        "of an unverified raw read from the page cache unless the hash runs 9x faster than "
        "the copy. Each 256 KiB piece is hashed right after it is read (writes: before it is "
        "written), while it is in cache, so hashing never reads memory twice. Cold reads "
        "and writes with fsync are disk-bound: there the hash is a few percent.",
        "**Before (issue 15, idle machine):** warm reads 0.59-0.70x of the raw file, writes "
        "0.62-0.88x, whole path. Changes since: I/O pieces of 256 KiB instead of 1 MiB (each "
        "hashed while it is in L2), and the benchmark separates the slab's I/O from the "
        "index, with unverified reads and a threaded raw file for reference. Per call the "
        "slab pays ~4-5 us besides the I/O (~2.5 us of it the path `stat` that notices a "
        "store deleted or moved away under a running engine; an `fstat` of the open file "
        "was tried and reverted because it does not), ~15% of a 256 KiB page-cache read.",
        "Reproduce: `.venv/bin/python benchmarks/bench_tiers.py --json docs/bench-data/"
        "tiers.json` (`--total-mib`, `--repeat`, `--threads`).",
    ]


# -- checksums and lookups -------------------------------------------------------------


def bench_checksums(quick: bool) -> list[dict]:
    funcs: dict[str, Callable] = {
        "xxh3_64": xxhash.xxh3_64_intdigest, "xxh3_128": xxhash.xxh3_128_intdigest,
        "xxh64": xxhash.xxh64_intdigest, "crc32 (zlib)": zlib.crc32,
        "blake2b": lambda b: hashlib.blake2b(b).digest(),
        "sha256": lambda b: hashlib.sha256(b).digest(),
    }
    try:
        import blake3

        funcs["blake3 (1 thread)"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    rows = []
    for size in (256 * KiB, 8 * MiB):
        buf = memoryview(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8))
        for name, fn in funcs.items():
            fn(buf)
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < (0.05 if quick else 0.25):
                fn(buf)
                n += 1
            gbps = n * size / (time.perf_counter() - start) / 1e9
            rows.append({"algorithm": name, "chunk": size, "gbps": round(gbps, 2)})
    return rows


def bench_lookup(args: argparse.Namespace, base: Path) -> list[dict]:
    """Per-key cost of find_prefix(64 keys) as the index grows; insert cost alongside."""
    root = Path(tempfile.mkdtemp(dir=base))
    largest = max(args.lookup_keys)
    index = DiskIndex.open(root, namespace_id="100c", descriptor={"bench": "lookup"},
                           slot_bytes=4096, num_ranks=1, capacity_bytes=largest * 4096)
    keys: list[bytes] = []
    rng, rows = random.Random(0), []
    for target in sorted(args.lookup_keys):
        insert_s, new = 0.0, target - len(keys)
        while len(keys) < target:
            batch = [os.urandom(32) for _ in range(min(1000, target - len(keys)))]
            start = time.perf_counter()
            slots = index.allocate(batch)
            index.commit([(k, s, (0,)) for k, s in zip(batch, slots)])
            insert_s += time.perf_counter() - start
            keys += batch
        index.flush_access()
        calls = 200 if args.quick else 2000
        lookup_s = flush_s = 0.0
        for n in range(calls):
            start_at = rng.randrange(len(keys) - 64)
            batch = keys[start_at : start_at + 64]
            start = time.perf_counter()
            found = index.find_prefix(batch)
            lookup_s += time.perf_counter() - start
            if len(found) != 64:
                raise RuntimeError("lookup bench: keys went missing")
            if n % 100 == 99:  # the scheduler flushes accesses periodically
                flush_s += timed(index.flush_access)
        miss = min(timed(partial(index.find_prefix, [os.urandom(32)] + keys[:63]))
                   for _ in range(200))
        rows.append({
            "keys": target,
            "lookup_us_per_key": round(lookup_s / (calls * 64) * 1e6, 2),
            "flush_us_per_key": round(flush_s / (calls * 64) * 1e6, 2),
            "miss_us_per_call": round(miss * 1e6, 2),
            "insert_us_per_key": round(insert_s / max(new, 1) * 1e6, 2),
            "index_bytes_per_key": round(os.path.getsize(root / "index" / "data.mdb") / target),
        })
    index.close()
    shutil.rmtree(root)
    return rows


# -- main -----------------------------------------------------------------------------


def print_tables(result: dict) -> None:
    load = (result["machine"]["loadavg_start"][0], result["machine"]["loadavg_end"][0])
    print(f"\nDisk tier I/O ({result['io_total_mib']} MiB per chunk size; GB/s; "
          f"{result['cache_note']}; load average {load[0]:.1f} -> {load[1]:.1f})")
    print(f"{'chunk':>8} {'contender':<38} {'write':>7} {'w+sync':>7} {'rd warm':>8} "
          f"{'rd cold':>8}")
    for r in result["io"]:
        size = f"{r['chunk'] // KiB} KiB" if r["chunk"] else "-"
        if "error" in r:
            print(f"{size:>8} {r['contender']:<38} n/a: {r['error'][:80]}")
            continue
        print(f"{size:>8} {r['contender']:<38} {r['write_gbps']:>7.2f} {r['write_sync_gbps']:>7.2f}"
              f" {r['read_warm_gbps']:>8.2f} {r['read_cold_gbps']:>8.2f}")
    print("\nRatios ours / other")
    for r in result["io_ratios"]:
        print(f"{r['chunk'] // KiB:>5} KiB {r['ours']:<38} / {r['vs'].split(' [')[0]:<38} "
              f"write {r['write']:.2f}  "
              f"w+sync {r['write_sync']:.2f}  rd warm {r['read_warm']:.2f}  "
              f"rd cold {r['read_cold']:.2f}")
    print("\nChecksums (GB/s)")
    for r in result["checksums"]:
        print(f"{r['chunk'] // KiB:>5} KiB {r['algorithm']:<18} {r['gbps']:>7.2f}")
    print("\nIndex find_prefix(64 keys)")
    for r in result["lookup"]:
        print(f"{r['keys']:>9} keys: {r['lookup_us_per_key']:.2f} us/key lookup, "
              f"{r['flush_us_per_key']:.2f} us/key access flush, {r['miss_us_per_call']:.1f} us "
              f"per missing lookup, {r['insert_us_per_key']:.1f} us/key insert, "
              f"{r['index_bytes_per_key']} index bytes/key")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="kv-offload-bench-", dir=args.dir))
    started = time.perf_counter()
    try:
        result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "dir": str(base),
                        "loadavg_start": os.getloadavg()},
            "io_total_mib": args.total_mib,
            "cache_note": try_drop_caches(args.drop_caches),
        }
        result["io"] = bench_io(args, base)
        result["io_ratios"] = io_ratios(result["io"], args.threads)
        result["checksums"] = bench_checksums(args.quick)
        result["lookup"] = bench_lookup(args, base)
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["machine"]["loadavg_end"] = os.getloadavg()
        result["repeat"], result["threads"] = args.repeat, args.threads
        result["notes"] = notes(result)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_tables(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
