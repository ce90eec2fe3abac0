"""The tables of benchmarks/publish_gpu.py: each codec configuration's medians (rank 0), the phases of
publish, upload and staging, the peer phases of the steady syncs (publish_syncs.py), the server's side
of a version by world size, and the short table printed last."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from publish_syncs import percentiles, phase_table

if TYPE_CHECKING:
    from publish_gpu import Config


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(results: list[dict], codec_cfg: str, cfg: Config) -> dict:
    """Medians of one codec configuration's steps (rank 0), with every phase."""
    r0 = results[0]
    run = r0["runs"][codec_cfg]
    if "skipped" in run:
        return {"codec": codec_cfg, "skipped": run["skipped"]}
    rows = run["rows"]
    keys = sorted(
        {k for r in rows for k in r if k.endswith(("_ms", "_mb")) or k in ("bytes", "density", "decoded", "nnz")}
    )
    s = {k: med([r[k] for r in rows if k in r]) for k in keys}
    s.update(codec=codec_cfg, world=cfg.world, params=r0["params"], lr=r0["lr"], step_ms=med(r0["plain_step_ms"]))
    s["added_ms"] = s["step_publish_ms"] - s["step_ms"]
    s["checksum_ok"] = run.get("checksum_ok")
    s["anchor_s"] = run["anchor_s"]
    s["publish_peak_max_mb"] = max(r["publish_peak_mb"] for r in rows)
    by_frames: dict[int, list[dict]] = {}
    for r in run.get("mem_rows", []):
        by_frames.setdefault(int(r.get("encode_frames", 0)), []).append(r)
    s["memory"] = {  # gpu_encode_frames (0: default) -> (device-wide peak MB, torch's peak MB, sync wall p50 ms)
        f: (
            max(r.get("publish_device_mb", float("nan")) for r in rs),
            max(r["publish_peak_mb"] for r in rs),
            percentiles(rs, "wall")[0],
        )
        for f, rs in by_frames.items()
    }
    s["publish_device_mb"] = s["memory"].get(0, (float("nan"),))[0]
    s["p50_live"], s["p95_live"] = percentiles(rows, "wall")
    s["named_p50"] = med([r["named"] for r in rows])
    s["syncs"] = len(rows)
    for other in results[1:]:
        o = other["runs"][codec_cfg]
        if "rows" in o:
            s[f"rank{other['rank']}_added_ms"] = med([r["step_publish_ms"] for r in o["rows"]]) - med(
                other["plain_step_ms"]
            )
    return s


def report(results: list[dict], cfg: Config, card: str, log: list[str]) -> list[dict]:
    summaries = [summarize(results, c, cfg) for c in cfg.codecs]
    first = next(s for s in summaries if "skipped" not in s)
    log.append("")
    log.append(
        f"# {card}: {cfg.model}{'' if cfg.layers is None else f' ({cfg.layers} layers)'}, "
        f"{first['params'] / 1e9:.2f}B params, W={cfg.world}, density {first['density']:.2%} "
        f"(median of {cfg.steps} steps), ms; step without publish {first['step_ms']:.1f}"
    )
    for s in summaries:
        if "skipped" in s:
            log.append(f"## {s['codec']}: skipped ({s['skipped']})")
            continue
        log.append(f"## codec {s['codec']}")
        log.append(
            "publish on the training thread: "
            + " ".join(f"{k[4:-3]} {v:.1f}" for k, v in s.items() if k.startswith("pub_") and k.endswith("_ms"))
        )
        log.append("upload thread: " + " ".join(f"{k[3:-3]} {v:.1f}" for k, v in s.items() if k.startswith("up_")))
        log.append("server staging: " + " ".join(f"{k[3:-3]} {v:.1f}" for k, v in s.items() if k.startswith("st_")))
        log.append(
            f"publish peak GPU memory beyond the snapshot: {s['publish_peak_mb']:.0f} MB in torch's counters "
            f"(max {s['publish_peak_max_mb']:.0f}), {s['publish_device_mb']:.0f} MB device-wide "
            f"(mem_get_info, {cfg.mem_syncs} syncs); live checksum = publisher's: {s['checksum_ok']}"
        )
        log.extend(phase_table(results[0]["runs"][s["codec"]]["rows"], f"{cfg.model} W={cfg.world} {s['codec']}"))
        log.extend(memory_lines(s))
    rates = results[0].get("write_gbps") or {}
    log.append(
        "rank 0's files on tmpfs, GB/s per file (mapped_writes.CHOOSER; its first file not counted): "
        + "; ".join(f"{way} " + ", ".join(f"{r:.1f}" for r in v) for way, v in rates.items())
    )
    log.append(
        f"{'codec':>12} {'added':>7} | {'publish':>8} {'upload':>7} {'open':>6} {'stage':>7} {'commit':>7} "
        f"{'live':>7} | {'MB':>7} {'+10Gb/s':>8} {'peak MB':>8}"
    )
    for s in summaries:
        if "skipped" in s:
            continue
        log.append(
            f"{s['codec']:>12} {s['added_ms']:>7.1f} | {s['publish_ms']:>8.1f} {s['upload_ms']:>7.1f} "
            f"{s['open_ms']:>6.1f} {s['stage_ms']:>7.1f} {s['commit_ms']:>7.1f} {s['live_ms']:>7.1f} | "
            f"{s['bytes'] / 1e6:>7.1f} {s['link_10g_ms']:>8.1f} {s['publish_peak_mb']:>8.0f}"
        )
    return summaries


WORLD_PHASES = ("read", "h2d", "inflate", "decode", "translate", "gather", "partials", "plan")


def by_world(summaries: list[dict], card: str, log: list[str]) -> None:
    """One table over the world sizes run: per (W, codec), the server's open (and a second, warm open of
    the same version after it went live), staging by phase, the changed elements decoded and step end ->
    live (medians of the timed steps, ms)."""
    log.append("")
    log.append(f"# {card}: the server's side of a version of W parts (one engine), by world size; ms")
    head = ["W", "codec", "open", "reopen", "stage", *WORLD_PHASES, "decoded", "live"]
    log.append(" ".join(f"{h:>9}" for h in head))
    rows = [s for w in summaries for s in w["summary"] if "skipped" not in s]
    for s in rows:
        cells = [str(s["world"]), s["codec"], f"{s['open_ms']:.1f}", f"{s.get('reopen_ms', float('nan')):.1f}"]
        cells.append(f"{s['stage_ms']:.1f}")
        cells += [f"{s.get(f'st_{p}_ms', 0.0):.1f}" for p in WORLD_PHASES]
        cells += [f"{s.get('decoded', float('nan')):.0f}", f"{s['live_ms']:.1f}"]
        log.append(" ".join(f"{c:>9}" for c in cells))
    for codec in dict.fromkeys(s["codec"] for s in rows):
        one = next((s for s in rows if s["codec"] == codec and s["world"] == 1), None)
        if one is None:
            continue
        for s in rows:
            if s["codec"] == codec and s["world"] > 1:
                log.append(
                    f"  {codec} W={s['world']}: stage {s['stage_ms'] / one['stage_ms']:.2f}x W=1, live "
                    f"{s['live_ms'] / one['live_ms']:.2f}x W=1 (issue 25: <= 1), open {s['open_ms']:.1f} ms "
                    f"(issue 25: < 10)"
                )


def final_table(summaries: list[dict], card: str) -> list[str]:
    """The short table printed last: per world size and codec, step end -> live p50 / p95, the named
    share of the wall, the publish's device-wide memory, and whether every live checksum agreed."""
    out = ["", f"# {card}: step end -> live over the steady syncs, ms (publish_syncs.py)"]
    out.append(f"{'W':>3} {'codec':>12} {'syncs':>5} {'p50':>8} {'p95':>8} {'named':>6} {'dev MB':>7} {'checksums':>9}")
    for w in summaries:
        for s in w["summary"]:
            if "skipped" in s:
                out.append(f"{'':>3} {s['codec']:>12} skipped: {s['skipped']}")
                continue
            out.append(
                f"{s['world']:>3} {s['codec']:>12} {s['syncs']:>5} {s['p50_live']:>8.1f} {s['p95_live']:>8.1f} "
                f"{s['named_p50']:>6.1%} {s['publish_device_mb']:>7.0f} {'equal' if s['checksum_ok'] else 'DIFFER':>9}"
            )
            out.extend("    " + line for line in memory_lines(s) if "=default" not in line)
    return out


def memory_lines(s: dict) -> list[str]:
    """The publish's GPU memory beyond the snapshot at each gpu_encode_frames measured (0: the default)."""
    out = []
    for frames, (dev, torch_mb, wall) in sorted(s.get("memory", {}).items()):
        out.append(
            f"publish memory, gpu_encode_frames={frames or 'default'}: {dev:.0f} MB device-wide, {torch_mb:.0f} MB in "
            f"torch's counters; step end -> live {wall:.1f} ms (p50 of those syncs, the sampler running)"
        )
    return out
