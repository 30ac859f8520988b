"""The `kv-offload` command: warm, inspect, verify and clear disk stores.

Exit codes: 0 success; 1 the operation failed or found damage (engine failure, writes
not durable, chunks not stored, bad chunks left, inconsistent or corrupt index); 2 a
usage error (bad arguments, missing or invalid paths, not a store, unknown namespace);
3 the store is in use by another process (clear without --force). Expected errors print
one line naming the problem and the fix; no path ends in a traceback (an unexpected error
prints one line that says to report it). inspect and verify without --repair never write
to a store. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kv_offload.config import OffloadConfig, format_size, parse_size
from kv_offload.disk import StoreError, StorePathError, clear
from kv_offload.disk.admin import (
    check_namespace,
    chunk_bytes,
    disk_bytes,
    prove_store,
    read_namespaces,
    repair_and_check,
    require_store,
    scan_namespace,
    store_users,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_BUSY = 0, 1, 2, 3
_NAMESPACE_ARG = re.compile(r"[0-9a-fA-F]{1,128}")


class CliError(Exception):
    """An expected failure: print ``message`` and exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def _err(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


# -- store helpers -----------------------------------------------------------------------------


def open_store(path: str) -> tuple[Path, list[dict]]:
    """(root, namespaces) of an existing store, read-only; CliError naming the problem if
    it is not one or its index cannot be read."""
    root = Path(path).expanduser()
    try:
        require_store(root)
    except StorePathError as exc:
        raise CliError(str(exc)) from None
    try:
        return root, read_namespaces(root)
    except StorePathError as exc:  # a link or another program's LMDB environment
        raise CliError(str(exc)) from None
    except StoreError as exc:
        raise CliError(str(exc), EXIT_FAILURE) from None


def open_store_to_clear(path: str) -> tuple[Path, list[dict] | None, str]:
    """(root, namespaces, why) of a directory proven to be a store (``prove_store``;
    CliError otherwise, nothing deleted). A store whose index cannot be read (or that
    has none) gives namespaces None and ``why`` says why."""
    root = Path(path).expanduser()
    try:
        prove_store(root)
    except StorePathError as exc:
        raise CliError(str(exc)) from None
    try:
        require_store(root)
        return root, read_namespaces(root), ""
    except StoreError as exc:
        return root, None, str(exc)


def check_namespace_arg(wanted: str) -> None:
    """CliError unless ``wanted`` can name a namespace: 1-128 hex digits."""
    if not _NAMESPACE_ARG.fullmatch(wanted):
        raise CliError(f"--namespace {wanted!r} is not a namespace id: give an id or a unique "
                       "prefix of one (hex digits, as `kv-offload inspect` lists them); to "
                       "act on the whole store, leave --namespace out")


def resolve_namespaces(namespaces: list[dict], wanted: str | None) -> list[dict]:
    """All namespaces, or the one whose id is or starts with ``wanted`` (unique prefix).
    CliError for an empty or non-hex ``wanted``: an unset shell variable never selects
    every namespace."""
    if wanted is None:
        return namespaces
    check_namespace_arg(wanted)
    hits = [n for n in namespaces if n["namespace_id"].startswith(wanted.lower())]
    exact = [n for n in hits if n["namespace_id"] == wanted.lower()]
    if len(exact) == 1 or len(hits) == 1:
        return exact or hits
    known = ", ".join(n["namespace_id"] for n in namespaces) or "none"
    what = "matches several namespaces" if hits else "is not a namespace of this store"
    raise CliError(f"--namespace {wanted} {what}; namespaces: {known} (see `kv-offload inspect`)")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _when(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch).isoformat(sep=" ",
                                                                              timespec="seconds")


# -- inspect -----------------------------------------------------------------------------------


def _namespace_report(root: Path, ns: dict) -> dict:
    c, chunk = ns["counters"], chunk_bytes(ns)
    return {
        "namespace_id": ns["namespace_id"], "descriptor": ns["descriptor"],
        "created": ns.get("created"), "chunk_tokens": ns["descriptor"].get("chunk_tokens"),
        "slot_bytes": ns["slot_bytes"], "num_ranks": ns["num_ranks"], "chunk_bytes": chunk,
        "chunks": c["entries"], "tails": ns.get("tails", 0), "reserved": c["reserved"],
        "num_slots": ns["num_slots"],
        "used_bytes": c["entries"] * chunk, "capacity_bytes": ns["num_slots"] * chunk,
        "disk_bytes": disk_bytes(root, ns["namespace_id"]),
        "oldest_access": _when(ns["oldest_access"]), "newest_access": _when(ns["newest_access"]),
        "counters": {k: c[k] for k in ("hits", "misses", "checksum_failures", "commits",
                                       "evictions", "reclaimed") if k in c},
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.remote or args.remote_cluster:
        return _inspect_remote(args)
    if args.path is None:
        raise CliError("give a store directory, --remote URL or --remote-cluster NODES")
    root, namespaces = open_store(args.path)
    reports = [_namespace_report(root, ns)
               for ns in resolve_namespaces(namespaces, args.namespace)]
    total = {k: sum(r[k] for r in reports) for k in ("chunks", "used_bytes", "capacity_bytes",
                                                     "disk_bytes")}
    if args.json:
        print(json.dumps({"path": str(root), **total, "namespaces": reports}, indent=2))
        return EXIT_OK
    print(f"store {root}: {_plural(len(reports), 'namespace')}, {total['chunks']} chunks, "
          f"{format_size(total['used_bytes'])} used of {format_size(total['capacity_bytes'])}, "
          f"{format_size(total['disk_bytes'])} on disk")
    for r in reports:
        d, c = r["descriptor"], r["counters"]
        pct = 100 * r["used_bytes"] / max(r["capacity_bytes"], 1)
        print(f"\nnamespace {r['namespace_id']}")
        print(f"  model      {d.get('model', '?')}")
        print(f"  layout     {d.get('dtype')} (KV {d.get('kv_cache_dtype')}), "
              f"{d.get('num_layers')} layers, {d.get('attention')}, block {d.get('block_size')}"
              f", TP {d.get('tp_size')}, hash {d.get('hash_algo')}"
              + (f", salt {d['salt']!r}" if d.get("salt") else ""))
        print(f"  chunk      {r['chunk_tokens']} tokens = {format_size(r['slot_bytes'])} x "
              f"{r['num_ranks']} rank(s) = {format_size(r['chunk_bytes'])}")
        print(f"  chunks     {r['chunks']} of {r['num_slots']} slots"
              + (f", {r['tails']} of them request tails" if r["tails"] else "")
              + (f" ({r['reserved']} being written)" if r["reserved"] else ""))
        print(f"  bytes      {format_size(r['used_bytes'])} used of "
              f"{format_size(r['capacity_bytes'])} ({pct:.0f}%), "
              f"{format_size(r['disk_bytes'])} on disk")
        print(f"  access     oldest {r['oldest_access'] or '-'}, "
              f"newest {r['newest_access'] or '-'}")
        print("  counters   " + ", ".join(f"{k} {v}" for k, v in c.items()))
        print(f"  created    {r['created'] or '?'}")
    return EXIT_OK


def _inspect_remote(args: argparse.Namespace) -> int:
    from kv_offload.remote import RemoteTarget
    from kv_offload.remote.inspect import format_report, inspect_remote

    config = OffloadConfig(remote_url=args.remote, remote_cluster_nodes=args.remote_cluster,
                           remote_key_prefix=args.key_prefix)  # validates the addresses
    target = RemoteTarget(config.remote_url, tuple(config.remote_cluster_nodes or ()))
    try:
        report = inspect_remote(target, key_prefix=config.remote_key_prefix,
                                namespace=args.namespace)
    except Exception as exc:  # connection refused, timeout, auth
        raise CliError(f"cannot read {target.describe()}: {exc}", EXIT_FAILURE) from None
    print(json.dumps(report, indent=2) if args.json else "\n".join(format_report(report)))
    if args.path is not None:
        print()
        args.remote = args.remote_cluster = None
        return cmd_inspect(args)
    return EXIT_OK


# -- verify ------------------------------------------------------------------------------------


def _verify_namespace(root: Path, ns: dict) -> tuple[int, list[tuple], list[tuple]]:
    """scan_namespace with a progress bar on stderr (a line at the end off a terminal)."""
    nid, total = ns["namespace_id"], ns["counters"]["entries"]
    bar = tqdm(total=total * chunk_bytes(ns), desc=f"verify {nid[:12]}", unit="B",
               unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=True,
               disable=not sys.stderr.isatty())
    start = time.monotonic()
    def advance(num_bad: int) -> None:
        bar.update(chunk_bytes(ns))
        bar.set_postfix(bad=num_bad, refresh=False)

    with bar:
        done, bad, bad_records = scan_namespace(root, ns, on_chunk=advance)
    rate = done * chunk_bytes(ns) / max(time.monotonic() - start, 1e-9)
    _err(f"verify {nid[:12]}: {done}/{total} chunks, {format_size(int(rate))}/s, "
         f"{len(bad)} bad" + (f", {len(bad_records)} bad records" if bad_records else ""))
    return done, bad, bad_records


def cmd_verify(args: argparse.Namespace) -> int:
    root, namespaces = open_store(args.path)
    chosen = resolve_namespaces(namespaces, args.namespace)
    num_bad, num_problems = 0, 0
    for ns in chosen:
        nid = ns["namespace_id"]
        try:
            done, bad, bad_records = _verify_namespace(root, ns)
            entries = list({entry.key: entry for entry, _, _ in bad}.values())
            problems = (repair_and_check(root, ns, entries, [k for k, _ in bad_records])
                        if args.repair else check_namespace(root, nid))
        except StoreError as exc:
            raise CliError(str(exc), EXIT_FAILURE) from None
        for entry, rank, reason in bad:
            print(f"bad chunk: namespace {nid[:12]} key {entry.key.hex()[:16]} "
                  f"slot {entry.slot} rank {rank}: {reason}")
        for key, why in bad_records:
            print(f"bad record: namespace {nid[:12]} key {key.hex()[:16]}: {why}")
        for problem in problems:
            print(f"index problem: namespace {nid[:12]}: {problem}")
        found = len(entries) + len(bad_records)
        num_bad, num_problems = num_bad + found, num_problems + len(problems)
        action = f", dropped {found}" if args.repair and found else ""
        records = f" ({len(bad_records)} bad index records)" if bad_records else ""
        print(f"namespace {nid}: {done} chunks checked, {found} bad{records}{action}, "
              f"index {'consistent' if not problems else 'INCONSISTENT'}")
    if num_bad and not args.repair:
        also = (f" and re-check the {num_problems} index problems" if num_problems else "")
        print(f"FAILED: {num_bad} bad chunks or records; run `kv-offload verify {args.path} "
              f"--repair` to drop them{also} (they are only misses until then: loads check "
              "checksums and records)")
        return EXIT_FAILURE
    if num_problems:
        print(f"FAILED: {num_problems} index problems; the store is only a cache: run "
              f"`kv-offload clear {args.path} --namespace ID` for the namespaces above")
        return EXIT_FAILURE
    if not num_bad:
        print(f"OK: {_plural(len(chosen), 'namespace')}, no bad chunks")
        return EXIT_OK
    print(f"repaired: dropped {num_bad} bad chunks or records; they are recomputed when next "
          "needed")
    return EXIT_OK


# -- clear -------------------------------------------------------------------------------------


def cmd_clear(args: argparse.Namespace) -> int:
    # A store proven to be ours whose index cannot be read can still be cleared as a
    # whole: that is the fix its errors name. A namespace needs a readable index.
    root, namespaces, unreadable = open_store_to_clear(args.path)
    if namespaces is None and args.namespace is not None:
        check_namespace_arg(args.namespace)  # a malformed id is a usage error first
        raise CliError(f"cannot clear one namespace: {unreadable}; clear the whole store "
                       f"with `kv-offload clear {root}`", EXIT_FAILURE)
    if namespaces is None:
        _err(f"warning: clearing a store whose index cannot be read: {unreadable}")
    chosen = resolve_namespaces(namespaces or [], args.namespace)
    nid = chosen[0]["namespace_id"] if args.namespace is not None else None
    users = store_users(root, nid)
    if users:
        who = ", ".join(f"pid {pid} ({name})" for pid, name in sorted(users.items()))
        if not args.force:
            raise CliError(f"{'namespace ' + nid if nid else 'the store'} in {root} is in use by "
                           f"{who}; stop those processes first, or pass --force (they then see "
                           "misses, never wrong data)", EXIT_BUSY)
        _err(f"warning: clearing while in use by {who} (--force)")
    chunks = sum(n["counters"]["entries"] for n in chosen)
    size = sum(n["counters"]["entries"] * chunk_bytes(n) for n in chosen)
    try:
        left = clear(root, nid)
    except StorePathError as exc:
        raise CliError(str(exc)) from None
    except StoreError as exc:
        raise CliError(str(exc), EXIT_FAILURE) from None
    what = f"namespace {nid}" if nid else f"store {root} ({_plural(len(chosen), 'namespace')})"
    print(f"cleared store {root} (its index was unreadable)" if namespaces is None
          else f"cleared {what}: {chunks} chunks, {format_size(size)}")
    if left:
        shown = ", ".join(str(p) for p in left[:5]) + (", ..." if len(left) > 5 else "")
        _err(f"note: left {_plural(len(left), 'path')} kv-offload did not create: {shown}")
    return EXIT_OK


# -- warm --------------------------------------------------------------------------------------


def _offload_config(args: argparse.Namespace) -> OffloadConfig:
    extra: dict[str, Any] = {}
    if args.config:
        try:
            text = Path(args.config).expanduser().read_text()
        except OSError as exc:
            raise CliError(f"cannot read --config {args.config}: {exc.strerror}") from None
        try:
            extra = OffloadConfig.from_json(text).to_extra_config()
        except ValueError as exc:
            raise CliError(f"--config {args.config}: {exc}") from None
    for name in ("disk_path", "disk_size", "cpu_size", "chunk_tokens", "namespace_salt",
                 "io_threads"):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    return OffloadConfig.from_extra_config(extra)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    engine = {name: getattr(args, name) for name in (
        "block_size", "max_model_len", "dtype", "tensor_parallel_size", "gpu_memory_utilization",
        "prefix_caching_hash_algo") if getattr(args, name) is not None}
    if args.kv_cache_memory is not None:
        engine["kv_cache_memory_bytes"] = parse_size(args.kv_cache_memory, name="--kv-cache-memory")
    if args.enforce_eager:
        engine["enforce_eager"] = True
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--engine-arg {item!r}: write KEY=VALUE, e.g. max_num_seqs=64")
        try:
            engine[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            engine[key.replace("-", "_")] = value
    return engine


def cmd_warm(args: argparse.Namespace) -> int:
    from kv_offload.tools.warm import WarmError, WarmOptions, run_warm

    options = WarmOptions(
        model=args.model, prompts=Path(args.prompts), offload=_offload_config(args),
        engine=_engine_kwargs(args), batch_size=args.batch_size, timeout_s=args.timeout,
        show_progress=not args.no_progress, quiet_engine=not args.verbose)
    try:
        summary = run_warm(options)
    except WarmError as exc:
        raise CliError(str(exc), EXIT_FAILURE) from None
    print(json.dumps(summary.to_dict(), indent=2) if args.json else "\n".join(summary.lines()))
    return EXIT_OK if summary.complete else EXIT_FAILURE


# -- argument parsing --------------------------------------------------------------------------


def _add_warm(sub: Any) -> None:
    p = sub.add_parser(
        "warm", help="fill a disk store ahead of serving",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prefill prompts in an offline vLLM engine with kv-offload on, so that\n"
        "their KV is in the disk store before serving starts. Incremental: chunks already\n"
        "stored are not written again. Use the server's model string and engine settings\n"
        "(dtype, block size, chunk tokens, TP size, salt): they name the namespace, and\n"
        "another namespace never hits.",
        epilog="prompt files: .jsonl ({\"prompt\": ...} or {\"messages\": [...]}, optional "
        "\"cache_salt\"), .txt (one prompt per line) or a directory of .txt files (one prompt "
        "per file)\n\nexample:\n  kv-offload warm --model meta-llama/Llama-3.1-8B-Instruct "
        "--prompts docs.jsonl \\\n      --disk-path /var/cache/kv-offload --disk-size 500GiB")
    p.add_argument("--model", required=True, help="model directory or hub name, exactly as "
                   "the server gets it")
    p.add_argument("--prompts", required=True, metavar="FILE", help=".jsonl, .txt or a directory")
    g = p.add_argument_group("kv-offload options (flags override --config)")
    g.add_argument("--config", metavar="JSON_FILE", help="file with a --kv-transfer-config "
                   "JSON or its kv_connector_extra_config object")
    g.add_argument("--disk-path", metavar="PATH",
                   help="store directory (required here or in --config)")
    g.add_argument("--disk-size", metavar="SIZE", help="disk budget of the namespace, e.g. 100GiB")
    g.add_argument("--cpu-size", metavar="SIZE",
                   help="CPU tier per worker; it stages every store (4GiB)")
    g.add_argument("--chunk-tokens", metavar="N", type=int,
                   help="tokens per chunk (multiple of the block size)")
    g.add_argument("--namespace-salt", metavar="SALT",
                   help="the server's namespace_salt, if it sets one")
    g.add_argument("--io-threads", metavar="N", type=int, help="disk I/O threads per worker")
    e = p.add_argument_group("engine options (vLLM defaults unless given)")
    e.add_argument("--block-size", metavar="N", type=int)
    e.add_argument("--max-model-len", metavar="N", type=int, help="longer prompts are skipped")
    e.add_argument("--dtype", metavar="DTYPE", help="e.g. auto, bfloat16, float32")
    e.add_argument("--tensor-parallel-size", "-tp", metavar="N", type=int)
    e.add_argument("--kv-cache-memory", metavar="SIZE", help="KV cache size; on CPU the "
                   "default is 1GiB (vLLM's own default fails on small hosts)")
    e.add_argument("--gpu-memory-utilization", metavar="FRACTION", type=float)
    e.add_argument("--prefix-caching-hash-algo", metavar="NAME",
                   help="must match the server (default sha256)")
    e.add_argument("--enforce-eager", action="store_true", help="skip graph compilation "
                   "(faster start-up)")
    e.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other vllm.LLM argument (value parsed as JSON), repeatable")
    p.add_argument("--batch-size", metavar="N", type=int, default=32,
                   help="prompts per generate call (32)")
    p.add_argument("--timeout", metavar="SECONDS", type=float, default=120.0,
                   help="seconds to wait for the "
                   "last disk writes to be committed (120)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    p.set_defaults(func=cmd_warm)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-offload", description="Manage kv-offload disk stores: warm them ahead of "
        "serving, inspect, verify checksums, clear.",
        epilog="exit codes: 0 ok, 1 failed or damage found, 2 usage error, 3 store in use. "
        "Run `kv-offload COMMAND --help` for each command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_warm(sub)
    p = sub.add_parser("inspect", help="show namespaces, chunks, sizes and counters",
                       description="Show each namespace of a store: model and KV layout, "
                       "chunk size, chunks, bytes used and capacity, oldest and newest "
                       "access, persistent counters; with --remote, the same for a Redis or "
                       "Valkey remote tier and the server's memory and evictions. "
                       "Read-only; safe while engines run.")
    p.add_argument("path", nargs="?", help="store directory (the disk_path)")
    p.add_argument("--namespace", metavar="ID", help="only this namespace (id or unique prefix)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--remote", metavar="URL", help="also (or only) a remote tier: the "
                   "remote_url, e.g. redis://10.0.0.5:6379/0")
    p.add_argument("--remote-cluster", metavar="NODES", help="a Redis Cluster's seed nodes, "
                   "comma-separated host:port")
    p.add_argument("--key-prefix", default="kv-offload", help="the remote_key_prefix")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="read every chunk and check its checksums",
                       description="Read every chunk of every rank's slab and check its "
                       "checksum, and check the index's cross-references; list bad chunks. "
                       "With --repair, drop bad chunks from the index (they are recomputed "
                       "when next needed). Exit 1 if bad chunks or index problems remain.")
    p.add_argument("path", help="store directory (the disk_path)")
    p.add_argument("--namespace", metavar="ID", help="only this namespace (id or unique prefix)")
    p.add_argument("--repair", action="store_true", help="drop bad chunks from the index")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("clear", help="delete a store or one namespace",
                       description="Delete the whole store (index and slab files) or one "
                       "namespace. Refuses (exit 3) while another process has the store "
                       "(or that namespace's slab files) open, unless --force.")
    p.add_argument("path", help="store directory (the disk_path)")
    p.add_argument("--namespace", metavar="ID", help="only this namespace (id or unique prefix)")
    p.add_argument("--force", action="store_true", help="clear even while in use; running "
                   "engines then see misses, never wrong data")
    p.set_defaults(func=cmd_clear)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kv-offload` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except CliError as exc:
        _err(f"kv-offload {args.command}: error: {exc}")
        return exc.code
    except ValueError as exc:  # bad input: config values, prompt files, model paths
        _err(f"kv-offload {args.command}: error: {exc}")
        return EXIT_USAGE
    except StoreError as exc:  # a store problem a command did not expect
        _err(f"kv-offload {args.command}: error: {exc}")
        return EXIT_USAGE if isinstance(exc, StorePathError) else EXIT_FAILURE
    except BrokenPipeError:  # `kv-offload inspect | head`: the reader left
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except OSError as exc:  # permissions, a vanished file, a failing disk
        where = f" {exc.filename}" if exc.filename else ""
        _err(f"kv-offload {args.command}: error: cannot access{where}: "
             f"{exc.strerror or exc}; run as the user that owns it, or fix its permissions")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        _err(f"kv-offload {args.command}: interrupted (whatever was committed is kept)")
        return 130
    except Exception as exc:  # a bug: one line, not a traceback, and how to report it
        _err(f"kv-offload {args.command}: internal error: {type(exc).__name__}: {exc}; this is "
             "a kv-offload bug, please report it with the command you ran")
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
