#!/usr/bin/env python
"""GPU apply benchmark (issue 4): the pause of an in-place delta update, against vLLM's sparse path.

For Qwen3-0.6B/8B/32B-shaped parameter sets with vLLM's fused layouts (qkv_proj, gate_up_proj), and a
Qwen3-30B-A3B-shaped one (`--models qwen3-30b-a3b`: 48 layers, 128 experts stacked as vLLM's FusedMoE
holds them, w13 [E, 2I, H] / w2 [E, H, I], 18 432 expert tensors), with realistic changes (uniform
positions at the density, ~89% of diffs one ULP), in one run on one card:

  pause       ApplyEngine.commit wall time (fused scatter launch + stream sync), default backend
  triton/cuda the fused scatter kernel alone (CUDA events), each backend, same plan
  index_copy  one index_copy_ per local target, offsets and values already on the device
  nanmask     vLLM's load_checkpoint_weight_patches algorithm (NaN-filled full tensor per touched
              parameter, index_copy_, where + copy_ into the runtime view), inputs on the device
  dense       a dense copy of every parameter (what a full weight reload writes at least)
  floor       (6 B payload + 64 B per changed element) / copy bandwidth measured in this run
              (the probe's definition: a 32 B sector read + write per changed element);
              'sector floor' counts touched 32 B sectors instead of changed elements
  stage       ApplyEngine.stage from a local compact version file (page cache warm), by phase

Every method is checked bit-exact (GPU: checksums of the whole model + the written values; CPU
smoke: whole tensors against the torch reference). `--smoke` runs tiny shapes on CPU (the Triton
kernels under TRITON_INTERPRET=1) and exits nonzero on any mismatch; CI runs it.

    python benchmarks/apply_gpu.py --out DIR            # GPU: table, DIR/apply_gpu.{log,json,png}
    TRITON_INTERPRET=1 python benchmarks/apply_gpu.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from apply_report import FAILURES, check, dump, log, report  # noqa: E402

from vllm_delta.apply import scatter as S  # noqa: E402
from vllm_delta.apply.engine import ApplyEngine  # noqa: E402
from vllm_delta.bits import bit_view  # noqa: E402
from vllm_delta.checksums import MASK64  # noqa: E402
from vllm_delta.codec import chunked  # noqa: E402
from vllm_delta.codec.chunked import gpu  # noqa: E402
from vllm_delta.format import VersionFile  # noqa: E402
from vllm_delta.testing.apply_fixtures import (  # noqa: E402
    QWEN3,
    QWEN3_MOE,
    Qwen3Spec,
    index_copy_apply,
    local_changes,
    model_layout,
    nanmask_apply,
    random_changes,
    reference_apply,
    write_delta,
)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_events(fns, reps: int, device) -> float:
    """Median ms of fns[i % len(fns)]() over reps (CUDA events on GPU, wall clock on CPU)."""
    fns[0]()
    sync(device)
    out = []
    for r in range(reps):
        fn = fns[r % len(fns)]
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def time_wall(fn, reps: int, device) -> float:
    fn()
    sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def copy_bandwidth(device, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    b = torch.empty_like(a)
    ms = time_events([lambda a=a, b=b: b.copy_(a)], 10, device)
    return 2 * nbytes / (ms * 1e-3)


def dense_copy_ms(targets, reps, device) -> float:
    scratch = torch.empty(max(t.numel() for t in targets), dtype=torch.bfloat16, device=device)

    def copy_all():
        for t in targets:
            scratch[: t.numel()].copy_(t.view(-1))

    return time_events([copy_all], reps, device)


def build_model(spec, device, seed=0):
    tshapes, layout = model_layout(spec)
    gen = torch.Generator(device=device).manual_seed(seed)
    targets = []
    bad = 0
    for shape in tshapes.values():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02)
        bad += int((~torch.isfinite(t)).sum())
        targets.append(torch.nan_to_num_(t, nan=0.0, posinf=1.0, neginf=-1.0))
    if bad:
        log(f"# {spec.name}: randn gave {bad} non-finite bf16 values (set finite)")
    # HF tensors as views of the targets (every Qwen3 segment is a contiguous row box)
    hf = {}
    for name, segs in layout.segments.items():
        seg = segs[0]
        n = seg.rows * seg.cols
        hf[name] = targets[seg.target].view(-1)[seg.dst_offset : seg.dst_offset + n].view(layout.hf_shapes[name])
    return layout, targets, hf


def bits_of(targets):
    return [bit_view(t).clone() for t in targets]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def plan_values_ok(staged, want_new: bool) -> bool:
    """The bits at every staged address are the staged new (or old) bits."""
    for plan, new, old in zip(staged.plans, staged.new_bits, staged.old_bits):
        got = S.gather(plan, staged.backend if plan.fused else None)
        want = new if want_new else old
        if plan.fused:
            ok = plan.rel >= 0
            if not torch.equal(got[ok], want[ok]):
                return False
        elif not torch.equal(got, want):
            return False
    return True


def touched_sectors(staged) -> int:
    """Distinct 32-byte sectors the plans write."""
    total = 0
    for plan in staged.plans:
        if not plan.fused:
            continue
        addr = torch.repeat_interleave(plan.block_base, plan.block) + plan.rel.to(torch.int64)
        addr = addr[plan.rel >= 0]
        byte = plan.base.data_ptr() + addr * plan.base.element_size()
        total += int(torch.unique(byte // 32).numel())
    return total


@dataclass
class Config:
    """One model x density: what every step of `run_config` reads, and the row it fills."""

    spec: Any
    layout: Any
    targets: list[torch.Tensor]
    engine: ApplyEngine
    density: float
    args: argparse.Namespace
    device: torch.device
    changes: dict[str, Any]
    nnz: int
    row: dict[str, Any]
    before: list[torch.Tensor] | None = None  # the targets' bits before the update (--full-check / smoke)
    expect: list[torch.Tensor] | None = None  # the torch reference's result (--full-check / smoke)

    @property
    def tag(self) -> str:
        return f"{self.spec.name} {self.density}"


def run_config(spec, layout, targets, hf, engine, density, args, device, tmpdir, sums0, pool, bw):
    t0 = time.perf_counter()
    changes = random_changes(hf, density, seed=int(density * 1e6))
    nnz = sum(int(c[0].numel()) for c in changes.values())
    fingerprint = _fingerprint(changes)
    cfg = Config(spec, layout, targets, engine, density, args, device, changes, nnz, {"model": spec.name})
    cfg.row.update(density=density, nnz=nnz)
    log(f"  {spec.name} d={density:.3%}: nnz={nnz / 1e6:.2f}M, generated in {time.perf_counter() - t0:.1f}s")
    staged, vf, written = stage_each_path(cfg, tmpdir, pool)
    time_pause(cfg, staged, sums0)
    time_kernels(cfg, staged)
    # launch-configuration variants of each kernel (1% rows only); the defaults are the best seen
    if density == 0.01 and device.type == "cuda" and staged.plans[0].fused and "variants" not in args.skip:
        cfg.row["variants"] = tune(staged, device, args)
        log("    variants: " + " ".join(f"{k}={v:.3f}" for k, v in cfg.row["variants"].items()))
    if not args.full_check and density == 0.01:  # stray writes anywhere in the model?
        check(engine.live_sums() == sums0, f"{cfg.tag}: whole-model checksum after kernels/variants")
    check(_fingerprint(changes) == fingerprint, f"{cfg.tag}: change set intact after kernels")
    time_baselines(cfg, staged, fingerprint)
    # floors
    row = cfg.row
    row["floor_ms"] = (6 + 64) * nnz / bw * 1e3
    if device.type == "cuda":
        sectors = touched_sectors(staged)
        row["sectors"] = sectors
        row["sector_floor_ms"] = (6 * nnz + 64 * sectors) / bw * 1e3
    row["backend"] = engine.backend
    del staged, changes, cfg
    vf.close()
    for f in written:
        os.unlink(f)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def stage_each_path(cfg: Config, tmpdir: str, pool: ThreadPoolExecutor) -> tuple[Any, VersionFile, list[str]]:
    """(e) Staging from a local version file, by staging path: the old `compact` codec, and the chunked
    codec's CPU path (zstandard) and GPU path (nvCOMP); the first listed is the update used after.
    Returns it, its file, and the files written."""
    spec, density, args, device, row = cfg.spec, cfg.density, cfg.args, cfg.device, cfg.row
    written: list[str] = []
    staged = None
    row["stage_paths"] = {}
    vf = None
    for label in args.stage_paths.split(","):
        codec_name, _, path_kind = label.partition(":")
        path_kind, _, planes = path_kind.partition("/")  # "/torch": the chunked codec's torch planes
        if path_kind == "gpu" and not gpu.backend(device)[0]:
            continue
        path = os.path.join(tmpdir, f"{spec.name}-{density}-{codec_name}.safetensors")
        if not os.path.exists(path):
            shapes = cfg.layout.hf_shapes
            write_delta(path, version=1, base=0, codec=codec_name, shapes=shapes, changes=cfg.changes, pool=pool)
            written.append(path)
        f = VersionFile(path)
        st, rec = stage_one_path(cfg, f, path_kind, planes)
        row["stage_paths"][label] = rec
        check(st.nnz == cfg.nnz, f"{cfg.tag} {label}: staged {st.nnz} elements, expected {cfg.nnz}")
        log(
            f"    stage [{label}] {rec['ms']:.1f} ms (first {rec['first_ms']:.1f}), "
            f"file {rec['file_bytes'] / 1e6:.1f} MB "
            f"({rec['file_bytes'] / max(cfg.nnz, 1):.3f} B/elem): "
            + " ".join(f"{k}={v:.1f}" for k, v in rec["phases"].items() if k != "total")
            + " | device peak {:.0f} MB held {:.0f} MB host {:.0f} MB".format(
                st.memory["device_peak_bytes"] / 1e6,
                st.memory["device_held_bytes"] / 1e6,
                st.memory["host_bytes"] / 1e6,
            )
        )
        if staged is None:
            staged, vf = st, f
            row.update(
                file_bytes=rec["file_bytes"],
                stage_first_ms=rec["first_ms"],
                stage_ms=rec["ms"],
                stage_phases=rec["phases"],
                stage_memory=st.memory,
                staged_nnz=st.nnz,
                stage_path=label,
            )
        else:
            f.close()
            del st
    assert staged is not None and vf is not None
    return staged, vf, written


def stage_one_path(cfg: Config, f: VersionFile, path_kind: str, planes: str) -> tuple[Any, dict[str, Any]]:
    """One staging path, `--stage-reps` times: the last staging, and the record of the path's times."""
    os.environ[gpu.PATH_ENV] = "cpu" if path_kind == "cpu" else "auto"
    if planes:
        os.environ[chunked.PLANES_ENV] = planes
    stagings, st = [], None
    for _ in range(cfg.args.stage_reps):
        st = None
        sync(cfg.device)
        st = cfg.engine.stage([f])
        stagings.append(dict(st.timings))
    os.environ.pop(gpu.PATH_ENV, None)
    os.environ.pop(chunked.PLANES_ENV, None)
    steady = stagings[1:] or stagings
    rec = {
        "file_bytes": os.path.getsize(f.path),
        "first_ms": stagings[0]["total"],
        "ms": statistics.median(x["total"] for x in steady),
        "phases": {k: statistics.median(x.get(k, 0.0) for x in steady) for k in steady[0]},
        "memory": st.memory,
    }
    return st, rec


def time_pause(cfg: Config, staged, sums0) -> None:
    """(a) The pause: the engine's write wall time, then rollback; the written values checked (against
    the torch reference with --full-check, else at the plans' addresses and by the whole-model sums)."""
    engine, targets, args = cfg.engine, cfg.targets, cfg.args
    cfg.before = bits_of(targets) if args.full_check else None
    pauses = []
    for _ in range(args.reps):
        pauses.append(engine.patch(staged))
        engine.rollback(staged)
    cfg.row["pause_ms"] = statistics.median(pauses)
    engine.patch(staged)
    if args.full_check:
        expect = [t.clone() for t in targets]
        for t, b in zip(expect, cfg.before):
            bit_view(t).copy_(b)
        reference_apply(expect, cfg.layout, cfg.changes)
        cfg.expect = expect
        check(same(bits_of(targets), bits_of(expect)), f"{cfg.tag}: commit != torch reference")
    else:
        check(plan_values_ok(staged, True), f"{cfg.tag}: committed values")
        sums1 = engine.live_sums()
        moved = all((sums0[n] + staged.partials.get(n, 0)) & MASK64 == sums1[n] for n in sums1)
        check(moved, f"{cfg.tag}: whole-model checksum after commit")
    engine.rollback(staged)
    if args.full_check:
        check(same(bits_of(targets), cfg.before), f"{cfg.tag}: rollback")
    else:
        check(plan_values_ok(staged, False), f"{cfg.tag}: rollback values")


def time_kernels(cfg: Config, staged) -> None:
    """The fused kernel alone, each backend, same plan (alternating new/old bits, as commit/rollback)."""
    device, args, targets = cfg.device, cfg.args, cfg.targets
    for be in S.available_backends(device):
        if be == "torch" and device.type == "cuda":
            continue
        if not staged.plans[0].fused:
            continue
        plan, new, old = staged.plans[0], staged.new_bits[0], staged.old_bits[0]
        ms = time_events(
            [lambda p=plan, b=new, be=be: S.scatter_(p, b, be), lambda p=plan, b=old, be=be: S.scatter_(p, b, be)],
            args.reps * 2,
            device,
        )
        cfg.row[f"kernel_{be}_ms"] = ms
        S.scatter_(plan, new, be)
        sync(device)
        check(plan_values_ok(_as_backend(staged, be), True), f"{cfg.tag}: {be} kernel values")
        if args.full_check:
            check(same(bits_of(targets), bits_of(cfg.expect)), f"{cfg.tag}: {be} kernel != reference")
        S.scatter_(plan, old, be)
        sync(device)
        if args.full_check:
            check(same(bits_of(targets), cfg.before), f"{cfg.tag}: {be} rollback")


def time_baselines(cfg: Config, staged, fingerprint: tuple[int, int]) -> None:
    """(c) one index_copy_ per local target, (b) vLLM's NaN-mask sparse patch path; each checked, and the
    model put back to its base bits after each."""
    engine, targets, layout, args, device, row = cfg.engine, cfg.targets, cfg.layout, cfg.args, cfg.device, cfg.row
    per_target = local_changes(layout, cfg.changes)
    row["index_copy_ms"] = (
        time_events([lambda pt=per_target: index_copy_apply(targets, pt)], args.reps, device)
        if "index_copy" not in args.skip
        else float("nan")
    )
    if "index_copy" not in args.skip:
        check(plan_values_ok(staged, True), f"{cfg.tag}: index_copy values")
    if args.full_check:
        check(same(bits_of(targets), bits_of(cfg.expect)), f"{cfg.tag}: index_copy != reference")
    del per_target
    engine.patch(staged), engine.rollback(staged)  # back to the base bits (commit checks the state)

    check(_fingerprint(cfg.changes) == fingerprint, f"{cfg.tag}: change set intact after index_copy")
    patches = {n: (c[0], c[1].view(torch.bfloat16)) for n, c in cfg.changes.items() if c[0].numel()}
    try:
        row["nanmask_ms"] = (
            time_wall(lambda pa=patches: nanmask_apply(targets, layout, pa), args.nanmask_reps, device)
            if "nanmask" not in args.skip
            else float("nan")
        )
    except ValueError as exc:
        check(False, f"{cfg.tag}: nanmask refused its input: {exc}")
        row["nanmask_ms"] = float("nan")
    if "nanmask" not in args.skip:
        check(plan_values_ok(staged, True), f"{cfg.tag}: nanmask values")
    if args.full_check:
        check(same(bits_of(targets), bits_of(cfg.expect)), f"{cfg.tag}: nanmask != reference")
    del patches
    engine.patch(staged), engine.rollback(staged)
    if args.full_check:
        check(same(bits_of(targets), cfg.before), f"{cfg.tag}: restored after baselines")


def _fingerprint(changes) -> tuple[int, int]:
    pos = sum(int(c[0].sum()) for c in changes.values())
    val = sum(int(c[1].to(torch.int64).sum()) for c in changes.values())
    return pos, val


def tune(staged, device, args) -> dict[str, float]:
    from vllm_delta.apply import _cuda

    plan, new, old = staged.plans[0], staged.new_bits[0], staged.old_bits[0]
    out = {}
    saved = (S.TRITON_ROWS, S.TRITON_WARPS, _cuda.VEC)
    try:
        for be in S.available_backends(device):
            if be == "triton":
                variants = [(r, w, saved[2]) for r, w in ((1, 4), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16))]
            elif be == "cuda":
                variants = [(saved[0], saved[1], v) for v in (1, 4, 8)]
            else:
                continue
            for rows, warps, vec in variants:
                S.TRITON_ROWS, S.TRITON_WARPS, _cuda.VEC = rows, warps, vec
                fns = [lambda be=be: S.scatter_(plan, new, be), lambda be=be: S.scatter_(plan, old, be)]
                ms = time_events(fns, args.reps * 2, device)
                S.scatter_(plan, new, be)
                sync(device)
                check(plan_values_ok(_as_backend(staged, be), True), f"variant {be} {rows}/{warps}/{vec}")
                S.scatter_(plan, old, be)
                key = f"{be}:rows{rows}w{warps}" if be == "triton" else f"{be}:vec{vec}"
                out[key] = ms
    finally:
        S.TRITON_ROWS, S.TRITON_WARPS, _cuda.VEC = saved
    return out


def _as_backend(staged, be):
    class _V:
        pass

    v = _V()
    v.plans, v.new_bits, v.old_bits, v.backend = staged.plans, staged.new_bits, staged.old_bits, be
    return v


def fits(spec, density, device) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, ""
    _, layout = model_layout(spec)
    params = sum(s.rows * s.cols for segs in layout.segments.values() for s in segs)
    nnz = params * density
    # model + changes (pos 8, new/old 4) + staged plan/bits (8) + staging temps + baselines (offsets 8 + 2)
    # + nanmask temporaries (~4 x the largest tensor)
    largest = spec.vocab * spec.hidden
    need = params * 2 + nnz * 40 + 8 * largest + (2 << 30)
    free = torch.cuda.mem_get_info(device)[0]
    return need < free, f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, bit-exact checks only")
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b,qwen3-32b")
    ap.add_argument("--densities", default="0.003,0.01,0.03")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--nanmask-reps", type=int, default=5)
    ap.add_argument("--stage-reps", type=int, default=4)
    ap.add_argument(
        "--stage-paths",
        default="chunked:gpu,chunked:cpu,compact",
        help="staging paths, the first is the update the other measurements use (codec[:cpu|gpu[/torch]]; "
        "/torch: the chunked codec's torch planes instead of its Triton kernels)",
    )
    ap.add_argument("--skip", default="", help="comma list of baselines to skip: nanmask, variants, index_copy")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    return ap.parse_args()


def choose_runs(args: argparse.Namespace) -> tuple[torch.device, list[str], list[float]] | None:
    """The device, models and densities (--smoke: tiny shapes on CPU, every check); None without a GPU."""
    if args.smoke:
        QWEN3["qwen3-smoke"] = Qwen3Spec("qwen3-smoke", 128, 2, 4, 2, 32, 256, 1000, False)
        args.reps, args.nanmask_reps, args.stage_reps = 2, 1, 1
        args.full_check = True
        return torch.device("cpu"), ["qwen3-tiny", "qwen3-smoke", "qwen3-moe-tiny"], [0.003, 0.03, 0.2]
    if not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
        return None
    args.full_check = False
    device = torch.device("cuda", torch.cuda.current_device())
    return device, args.models.split(","), [float(d) for d in args.densities.split(",")]


def log_setup(args: argparse.Namespace, device: torch.device, card: str) -> None:
    import triton

    log(
        f"# apply_gpu {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} card={card} "
        f"torch={torch.__version__} triton={triton.__version__}"
    )
    log(
        f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}"
        + (f" TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}" if args.smoke else "")
    )
    log(f"# backends on {device.type}: {S.available_backends(device)}")
    if device.type == "cuda":
        from vllm_delta.apply import _cuda

        if not _cuda.available():
            log(f"# CUDA fused scatter build failed: {_cuda.error()}")


def main() -> int:
    args = parse_args()
    runs = choose_runs(args)
    if runs is None:
        return 2
    device, models, densities = runs
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log_setup(args, device, card)
    bw = copy_bandwidth(device, (4 << 30) if device.type == "cuda" else (64 << 20))
    log(f"# copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    rows: list[dict[str, Any]] = []
    pool = ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory(prefix="apply-gpu-") as tmpdir:
        for name in models:
            ran = run_model(name, densities, args, device, tmpdir, pool, bw, rows)
            if ran and len(models) > 1 and name != models[-1]:
                report(rows, card, bw, args, device)  # so far (a later model may run out of time)
                dump(rows, card, bw, args, plot_too=False)
    pool.shutdown()
    report(rows, card, bw, args, device)
    if FAILURES:
        log(f"FAILED: {len(FAILURES)} mismatches")
        for f in FAILURES:
            log(f"  {f}")
    else:
        log("all methods bit-exact")
    dump(rows, card, bw, args)
    return 1 if FAILURES else 0


def run_model(name, densities, args, device, tmpdir, pool, bw, rows) -> bool:
    """Every density of one model that fits, on each engine backend, into `rows`; False if none fits."""
    spec = {**QWEN3, **QWEN3_MOE}[name]  # --models picks from both families
    todo = []
    for d in densities:
        ok, why = fits(spec, d, device)
        if ok:
            todo.append(d)
        else:
            log(f"# skip {name} d={d:.3%}: {why}")
            rows.append({"model": name, "density": d, "skipped": why})
    if not todo:
        return False
    t0 = time.perf_counter()
    layout, targets, hf = build_model(spec, device)
    params = sum(t.numel() for t in targets)
    # (d) a dense copy of the whole model
    dense_ms = dense_copy_ms(targets, max(3, args.reps // 4), device)
    # GPU: the default backend's engine (the other kernel runs on its plans); CPU smoke: every backend
    backends = [None] if device.type == "cuda" else S.available_backends(device)
    for be in backends:
        engine = ApplyEngine(dict(zip(layout.targets, targets)), layout, device, backend=be)
        sums0 = engine.live_sums() if not args.full_check else None
        log(
            f"## {name}: {params / 1e9:.3f}B params, {len(targets)} targets, {len(layout.hf_shapes)} HF "
            f"tensors, engine backend {engine.backend} (ready in {time.perf_counter() - t0:.1f}s)"
        )
        for d in todo:
            row = run_config(spec, layout, targets, hf, engine, d, args, device, tmpdir, sums0, pool, bw)
            row["dense_ms"] = dense_ms
            row["params"] = params
            rows.append(row)
        del engine
    del targets, hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return True


if __name__ == "__main__":
    sys.exit(main())
