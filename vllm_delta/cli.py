"""`vllm-delta` command line: inspect a store, materialize a version as an HF directory, retain, mark a
version bad, the fleet's ledger, the coverage report of a running server, signing keys (`keygen`) and
the check of a store's signatures (`verify`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from .errors import DeltaError


def _store(args):
    from .store import DeltaStore

    options = json.loads(args.storage_options) if args.storage_options else None
    return DeltaStore(args.uri, storage_options=options)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def cmd_inspect(args) -> int:
    store = _store(args)
    versions = [store.resolve(args.version)] if args.version is not None else store.versions()
    marks = store.marks()
    rows = []
    for v in versions:
        r = store.record(v)
        row = asdict(r)
        row["parts"] = [asdict(p) for p in r.parts]
        row["n_parts"] = len(r.files)
        row["density"] = r.density
        row["bytes_per_changed"] = r.bytes / r.nnz if r.nnz else None
        mark = marks.get(v)
        row["bad"] = asdict(mark) if mark is not None and mark.matches(r) else None
        rows.append(row)
    if args.json:
        print(json.dumps(rows if args.version is None else rows[0], indent=2))
        return 0
    if not rows:
        print(f"{store.uri}: no versions")
        return 0
    print(
        f"{'version':>8} {'kind':6} {'base':>6} {'codec':8} {'parts':>5} {'nnz':>12} {'density':>9} {'bytes':>10} "
        f"{'B/chg':>6}  checksum"
    )
    for r in rows:
        bpc = f"{r['bytes_per_changed']:.2f}" if r["kind"] == "delta" and r["nnz"] else "-"
        bad = f"  BAD: {r['bad']['reason'][:60]}" if r["bad"] else ""
        print(
            f"{r['version']:>8} {r['kind']:6} {r['base'] if r['base'] is not None else '-':>6} "
            f"{r['codec'] or '-':8} {r['n_parts']:>5} {r['nnz']:>12} {r['density']:>9.4%} {_human(r['bytes']):>10} "
            f"{bpc:>6}  {r['checksum']}{bad}"
        )
    if args.version is not None and rows[0]["parts"]:
        print(f"parts of version {rows[0]['version']}:")
        for i, part in enumerate(rows[0]["parts"]):
            print(f"{i:>8} {_human(part['bytes']):>10}  {part['checksum']}  {part['file']}")
    return 0


def cmd_materialize(args) -> int:
    from .reconstruct import materialize

    out = materialize(_store(args), args.version, args.out, progress=not args.quiet)
    print(out)
    return 0


def cmd_fleet(args) -> int:
    from .store.ledger import Ledger

    ledger = Ledger(_store(args), stale_after_s=args.stale_after)
    states = ledger.states()
    if args.json:
        rows = []
        for s in states:
            row = asdict(s.report)
            row.update(age_s=round(s.age_s, 1), stale=s.stale, lag=s.lag, checksum_ok=s.checksum_ok)
            row.update(marked_bad=s.marked_bad, blocked_by=s.blocked_by)
            rows.append(row)
        print(json.dumps(rows, indent=2))
        return 0
    marks = ledger.store.marks()
    for v, mark in sorted(marks.items()):
        print(f"version {v} is marked bad ({mark.by}, {_ago(mark.created)}): {mark.reason[:100]}")
    if not states:
        print(f'{ledger.store.uri}: no replica reports (servers report with "delta_report": true)')
        return 0
    print(
        f"{'replica':24} {'host':16} {'version':>8} {'lag':>4} {'checksum':9} {'heartbeat':>10} {'pause_ms':>9}  error"
    )
    for s in states:
        r = s.report
        ok = {True: "ok", False: "MISMATCH", None: "?"}[s.checksum_ok]
        beat = f"{s.age_s:.0f}s ago" + (" STALE" if s.stale else "")
        pause = f"{r.last_pause_ms:.1f}" if r.last_pause_ms is not None else "-"
        version = r.served_version if r.served_version is not None else "-"
        lag = s.lag if s.lag is not None else "-"
        note = (r.last_error or "")[:60]
        if s.marked_bad is not None:
            note = f"serves a version marked bad; {note}"
        elif s.blocked_by is not None:
            note = f"waits: version {s.blocked_by} is marked bad; {note}"
        print(
            f"{r.replica_id[:24]:24} {r.host[:16]:16} {version:>8} {lag:>4} {ok:9} {beat:>10} {pause:>9}  "
            f"{note.rstrip('; ')}"
        )
    return 0


def _ago(t: float) -> str:
    return f"{max(0.0, time.time() - t):.0f}s ago"


def cmd_mark_bad(args) -> int:
    mark = _store(args).mark_bad(args.version, args.reason, by=args.by)
    print(f"version {mark.version} (checksum {mark.checksum}) is marked bad: {mark.reason}")
    return 0


def cmd_keygen(args) -> int:
    from .signatures import PUBLIC_SUFFIX, keygen

    key = keygen(args.path)
    print(f"private key {args.path} (mode 600: keep it on the trainer), public key {args.path}{PUBLIC_SUFFIX}")
    print(f"fingerprint {key.fingerprint}")
    return 0


def cmd_verify(args) -> int:
    from .signatures import TrustedKeys
    from .store.signed import signature_state

    store = _store(args)
    trusted = TrustedKeys.load(args.trusted_key) if args.trusted_key else None
    versions = [store.resolve(args.version)] if args.version is not None else store.versions()
    states = [signature_state(store.record(v), trusted) for v in versions]
    if args.json:
        print(json.dumps([{**asdict(s), "ok": s.ok} for s in states], indent=2))
    else:
        if not states:
            print(f"{store.uri}: no versions")
        for s in states:
            who = f"by {s.key}" if s.key else ""
            trust = " (trusted)" if s.status == "signed" and trusted is not None else ""
            print(
                f"{s.version:>8} {s.status:9} {who}{trust}  run {s.run or '-'}" + (f"  {s.reason}" if s.reason else "")
            )
        bad = [s.version for s in states if not s.ok]
        print(f"{len(states) - len(bad)} of {len(states)} version(s) signed" + (" by a trusted key" if trusted else ""))
    return 0 if all(s.ok for s in states) else 1


def cmd_retain(args) -> int:
    deleted = _store(args).retain(args.keep_anchors)
    print(f"deleted {len(deleted)} version(s): {deleted}")
    return 0


def cmd_mirror(args) -> int:
    import signal
    import threading

    from .mirror import Mirror, MirrorOptions
    from .store import DeltaStore

    options = MirrorOptions(
        region=args.region,
        poll_s=args.poll_s,
        everything=args.all,
        keep_anchors=args.keep_anchors,
        owner=args.owner,
        lease_ttl_s=args.lease_ttl,
        forward_ledger=not args.no_ledger,
        mark_source=not args.no_mark_source,
    )
    src_options = json.loads(args.src_storage_options) if args.src_storage_options else None
    dst_options = json.loads(args.dst_storage_options) if args.dst_storage_options else None
    src = DeltaStore(args.src, storage_options=src_options)
    dst = DeltaStore(args.dst, storage_options=dst_options)
    m = Mirror(src, dst, options)
    if not args.follow:
        try:
            p = m.run_once()
        finally:
            m.close()
        print(f"{args.src} -> {args.dst}: copied {p.copied}, corrupt {p.corrupt}, skipped {sorted(p.skipped)}")
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"mirroring {args.src} -> {args.dst} as region {options.region!r} (owner {m.owner}); stop with SIGTERM")
    sys.stdout.flush()
    m.follow(stop)
    return 0


def fetch_status(server: str, api_key: str | None = None, timeout: float = 60.0) -> dict:
    """GET /v1/delta/status of a vLLM server with the plugin."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.rstrip("/") + "/v1/delta/status")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise DeltaError(f"{server} answered {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None
    except urllib.error.URLError as exc:
        raise DeltaError(f"can't reach {server}: {exc.reason}") from None


def format_coverage(cov: dict) -> str:
    """A coverage report (GET /v1/delta/status "coverage") as text."""
    total_t, total_e = cov["tensors"], cov["elements"]

    def row(label: str, part: dict) -> str:
        share = part["elements"] / total_e if total_e else 0.0
        return f"  {label:<26} {part['tensors']:>8} {part['elements']:>15,} {share:>8.2%}"

    lines = [
        f"  {'':<26} {'tensors':>8} {'elements':>15} {'share':>8}",
        f"  {'all Hugging Face tensors':<26} {total_t:>8} {total_e:>15,}",
        row("in place (fast)", cov["in_place"]),
        row("vLLM's sparse path (slow)", cov["vllm_path"]),
        row("recomputed after updates", cov["recomputed"]),
    ]
    verdict = "fully in place: every update is O(changed elements)" if cov["fully_in_place"] else "NOT fully in place"
    lines.append(f"  {verdict}")
    for name in cov["vllm_path"]["names"][:20]:
        lines.append(f"    via vLLM: {name}: {cov['vllm_path'].get('reasons', {}).get(name, '')}")
    if len(cov["vllm_path"]["names"]) > 20:
        lines.append(f"    ... and {len(cov['vllm_path']['names']) - 20} more")
    for name in cov["recomputed"]["names"][:20]:
        lines.append(f"    recomputed: {name}")
    for h in cov.get("handlers", []):
        lines.append(f"  handler {h['name']}: recompute cost {h['cost']}")
    return "\n".join(lines)


def cmd_coverage(args) -> int:
    status = fetch_status(args.server, args.api_key or os.environ.get("VLLM_API_KEY"))
    cov = status.get("coverage")
    if args.json:
        print(json.dumps({"version": status.get("version"), "coverage": cov}, indent=2))
        return 0
    if cov is None:
        print(f"{args.server}: no coverage report (a server without the plugin's layout)", file=sys.stderr)
        return 1
    print(f"{args.server}: version {status.get('version')}, live checksum {status.get('checksum')}")
    print(format_coverage(cov))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-delta", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def add(name, func, help_):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("uri", help="store: a path, file://, s3://bucket/prefix or hf://buckets/ns/bucket/prefix")
        sp.add_argument("--storage-options", help="fsspec storage options as JSON (e.g. S3 endpoint, keys)")
        sp.set_defaults(func=func)
        return sp

    sp = add("inspect", cmd_inspect, "list versions: kind, base, parts, nnz, density, bytes, checksum")
    sp.add_argument("--version", help="one version (a number or 'latest')")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = add("materialize", cmd_materialize, "write a version as an HF-loadable safetensors directory")
    sp.add_argument("--version", default="latest", help="a number or 'latest' (default)")
    sp.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")

    sp = add("fleet", cmd_fleet, "replicas following the store: version, lag, checksum, heartbeat (the ledger)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--stale-after", type=float, default=60.0, help="seconds after which a heartbeat is stale")

    sp = add(
        "mark-bad",
        cmd_mark_bad,
        "mark a version bad for the whole fleet: followers never apply it nor the deltas on it",
    )
    sp.add_argument("--version", required=True, help="the version (a number)")
    sp.add_argument("--reason", required=True, help="why (shown by inspect, fleet and the followers' status)")
    sp.add_argument("--by", help="who marks it (default: user@host:pid)")

    sp = sub.add_parser(
        "mirror", help="copy every new version of SRC into DST (a region), verified, records last; --follow"
    )
    sp.add_argument("src", help="the source store (the trainer's)")
    sp.add_argument("dst", help="the destination store (the region's)")
    sp.add_argument("--follow", action="store_true", help="keep following SRC until stopped (SIGTERM, Ctrl-C)")
    sp.add_argument("--region", default="mirror", help="the region's name in SRC's ledger (default: mirror)")
    sp.add_argument("--src-storage-options", help="fsspec storage options of SRC as JSON")
    sp.add_argument("--dst-storage-options", help="fsspec storage options of DST as JSON")
    sp.add_argument("--poll-s", type=float, default=2.0, help="seconds between passes with --follow (default 2)")
    sp.add_argument(
        "--all", action="store_true", help="first pass: every version SRC holds (default: its newest anchor on)"
    )
    sp.add_argument("--keep-anchors", type=int, help="DST's own retention after each mirrored anchor")
    sp.add_argument("--owner", help="the lease owner (default host-pid-random; the same owner resumes its lease)")
    sp.add_argument("--lease-ttl", type=float, default=30.0, help="seconds after which a silent holder's lease expires")
    sp.add_argument("--no-ledger", action="store_true", help="do not forward DST's replica reports to SRC")
    sp.add_argument("--no-mark-source", action="store_true", help="mark a corrupt SRC version bad in DST only")
    sp.set_defaults(func=cmd_mirror)

    sp = add(
        "verify",
        cmd_verify,
        "check the versions' signatures: unsigned, bad, or signed by which key (exit 1 unless all are signed)",
    )
    sp.add_argument("--version", help="one version (a number or 'latest')")
    sp.add_argument(
        "--trusted-key",
        action="append",
        help="a public key file (repeat for several): a version signed by any other key is 'untrusted'",
    )
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("keygen", help="a new Ed25519 key pair: the private key at PATH (0600), the public at PATH.pub")
    sp.add_argument("path", help="where to write the private key (never overwritten)")
    sp.set_defaults(func=cmd_keygen)

    sp = add("retain", cmd_retain, "delete all but the newest K anchors and the deltas that need them")
    sp.add_argument("--keep-anchors", type=int, required=True)

    sp = sub.add_parser("coverage", help="how a running server takes updates: in place, vLLM's path, recomputed")
    sp.add_argument("--server", required=True, help="the vLLM server's base URL, e.g. http://127.0.0.1:8000")
    sp.add_argument("--api-key", help="vLLM's --api-key (default: $VLLM_API_KEY)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_coverage)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "mark-bad" and args.version == "latest":
        print("vllm-delta: mark-bad takes a version number, not 'latest'", file=sys.stderr)
        return 2
    if getattr(args, "version", None) not in (None, "latest"):
        try:
            args.version = int(args.version)
        except ValueError:
            print(f"vllm-delta: --version must be a number or 'latest', not {args.version!r}", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except (DeltaError, FileExistsError, ValueError) as exc:
        print(f"vllm-delta: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
