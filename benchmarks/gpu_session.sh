#!/usr/bin/env bash
# One lent-GPU call: `STAGES="tests publish apply world2" bash benchmarks/gpu_session.sh` from the
# repository root (those four are the default: the sharded path always runs). Stages (each in its own
# process group, bounded by its own timeout; one that times out gets SIGABRT and prints every
# process's Python stacks into its log under $OUT):
#   tests     pytest -m gpu tests/apply tests/trainer tests/codec/test_codec_gpu.py tests/codec/test_codec_kernels.py (kernels,
#             engine, detection, the chunked codec's nvCOMP path against its CPU path, its Triton kernels
#             against its torch reference)
#   calls     benchmarks/codec_calls.py: the chunked codec's GPU steps by call size (tuning)     [issue 17]
#   codec     benchmarks/codec_gpu.py qwen3-8b + qwen3-30b-a3b: the codecs alone, old path beside new [issue 17]
#   publish   benchmarks/publish_gpu.py W=1                                          [issues 9, 17]
#   publish_torch  benchmarks/publish_gpu.py W=1 with the torch detection path        [issue 9]
#   world2    benchmarks/publish_gpu.py --world 2 (FSDP2 over NCCL; a 2-GPU machine)   [issues 9, 25]
#             two publishers one after the other (compact, then chunked:gpu): the hang of issue 25
#   world4    the same at --world 4 (a 4-GPU machine)                                    [issue 25]
#   worlds    benchmarks/publish_gpu.py --world 1,2,4 chunked:gpu: the server's open, staging phases and
#             time to live of a version of W parts, one table (a 4-GPU machine)           [issue 25 item 2]
#   worlds3   the same with format-3 headers (--header-format 3, stores in /dev/shm/open3): the A/B of format 4
#   open      benchmarks/open_parts.py on the stores a `worlds` stage kept (PUBLISH_ARGS="--store /dev/shm/open"):
#             where `open` of a version of W parts goes, per phase                       [issue 25 item 2]
#   tp2       benchmarks/stage_tp.py qwen3-8b + qwen3-30b-a3b at 1%, TP=1 beside TP=2 (a process and a GPU
#             per rank): each rank's decoded elements and staging time; then a version of 2 parts
#             (a 2-GPU machine)                                                          [issue 26 item 1]
#   apply     benchmarks/apply_gpu.py qwen3-8b + qwen3-30b-a3b at 1% and 3%, staging per path [issues 11, 17]
#   undo      benchmarks/undo_gpu.py qwen3-8b at 1%: one version back beside one forward (staging, write) [issue 36]
#   moe       benchmarks/publish_gpu.py for qwen3-30b-a3b, 12 of its 48 layers          [issue 17]
#   moe48     benchmarks/publish_gpu.py for the whole qwen3-30b-a3b (48 layers) at --world 2, the engine on a
#             third card (--engine-gpu 2: fp32 master weights sharded over two cards; a 4-GPU machine)  [issue 25 item 4]
#   old / oldmoe / oldmoe48  publish (8B, W=1, chunked:gpu) / moe / moe48 from the tree in $OLD_TREE (default .old: the code before,
#             `git archive <commit> | tar -x -C .old`, carried): today's path beside the old one in one call
#   profile   benchmarks/profile_stage.py (PROFILE_MODEL, default qwen3-8b): staging under cProfile and torch.profiler,
#             the device's busy share of the staging's wall time and the host's waits
#   memory35  benchmarks/nvcomp_temp.py (nvCOMP zstd's compression space by batch), then publish_gpu.py at 8B with
#             the memory bounds (gpu_encode_frames=ENCODE_FRAMES, default 256; stream_pass_elems=2^30)  [issue 35 item 6]
#   profsync  benchmarks/profile_sync.py (PROFILE_MODEL, default qwen3-8b): one steady sync under cProfile (training
#             thread, upload thread, staging), torch.profiler and torch's memory history: where its time and memory go
#   trainer   benchmarks/trainer_gpu.py (detection + prepare alone)
#   detect    benchmarks/detect_gpu.py (FlatSnapshot.changes: bitmask path vs chunked paths, 2^28/2^30)
#   issue35   steady syncs, old tree beside new, and the publish's device-wide memory (issue 35): publish_gpu.py
#             chunked:gpu over SYNCS (20) steady syncs at W=1,2,4 (a W that needs more GPUs than the host has
#             prints a line and is skipped) for Qwen3-8B and Qwen3-30B-A3B (12 layers), each also from the tree
#             in $OLD_TREE when there is one (OLD_SYNCS, 10); the 8B run's memory syncs also at
#             UploadOptions(gpu_encode_frames) = each of ENCODE_FRAMES (1024,256), and once more with rank blocks
#             (UploadOptions(rank_blocks=8), OLD_SYNCS syncs: the layout's cost); with 2 GPUs stage_tp.py at TP=1
#             and 2; with 4, the whole 30B-A3B at W=2 (engine on a third card), old beside new. Ends with
#             benchmarks/issue35_summary.py: one short table of every run
# Wheels missing on the machine (zstandard; nvCOMP: nvidia-nvcomp-cu13 and nvidia-libnvcomp-cu13, 6.0.0.12)
# travel in .whl (gitignored; carry it).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 - <<'PY' 2>&1 | tee "$OUT/env.log"
import torch, triton, zstandard, datetime, os
print(datetime.datetime.now(datetime.timezone.utc).isoformat(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
      "torch", torch.__version__, "triton", triton.__version__, "zstandard", zstandard.__version__, "cpus", os.cpu_count())
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee -a "$OUT/env.log"
# Every Python process prints its stacks on SIGABRT (spawned ranks inherit the variable).
export PYTHONFAULTHANDLER=1
# NVLink multicast stays off (KINDS.md): a program that uses it can take the host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # name timeout command...: in its own process group; past the timeout every process of the
  # group gets SIGABRT (each prints its Python stacks into the stage's log: a hang shows where), then SIGKILL
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  setsid "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  # The watchdog's sleep must end with the stage: a sleep left behind would hold the caller's stdout
  # open, and a piped caller (`... | tail`) would wait out the whole limit (device time, idle).
  ( sleep "$limit" & nap=$!
    trap 'kill "$nap" 2>/dev/null; exit 0' TERM
    wait "$nap"
    if kill -0 "$pid" 2>/dev/null; then
      echo "== $name: TIMED OUT after $limit s: SIGABRT to its process group (stacks above)" >> "$OUT/$name.log"
      kill -ABRT -- "-$pid" 2>/dev/null; sleep 15; kill -KILL -- "-$pid" 2>/dev/null
    fi ) > /dev/null 2>&1 &
  local dog=$!
  wait "$pid"; local rc=$?
  kill "$dog" 2>/dev/null; wait "$dog" 2>/dev/null
  echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s"
  tail -n ${TAIL:-25} "$OUT/$name.log"
}
old_tree() {  # command...: run in the old tree (its root first on the path, and the working folder)
  local tree; tree=$(cd "${OLD_TREE:-.old}" && pwd) || return 2
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH#$PWD:}" "$@")
}
export -f old_tree  # `run` starts it through bash -c (setsid runs programs, not functions)
issue35() {  # the issue-35 stage (header above); every run's JSON under $OUT, the table last
  local n; n=$(python3 -c "import torch; print(torch.cuda.device_count())")
  local syncs="--codecs chunked:gpu --steps ${SYNCS:-20} --warmup 1" moe="--model qwen3-30b-a3b --layers 12"
  local old=; [ -d "${OLD_TREE:-.old}/vllm_delta" ] && old=1
  local old_syncs="--codecs chunked:gpu --steps ${OLD_SYNCS:-10} --warmup 1"  # the old tree's medians, beside
  run syncs_8b ${SYNCS_LIMIT:-$(( n >= 2 ? 360 : 150 ))} python3 benchmarks/publish_gpu.py $syncs --world 1,2,4 --encode-frames ${ENCODE_FRAMES:-1024,256} --out "$OUT" --name syncs_8b
  [ "${RB8:-1}" = 1 ] && run syncs_8b_rb8 ${SYNCS_LIMIT:-150} python3 benchmarks/publish_gpu.py $old_syncs --mem-syncs 2 --rank-blocks 8 --out "$OUT/rb8/8b"
  # staging without the fused unit kernel (apply/stage_unit.py), beside: the kernel's share of the sync
  [ "${NOUNIT:-1}" = 1 ] && run syncs_8b_nounit ${SYNCS_LIMIT:-150} env VLLM_DELTA_STAGE_UNIT=0 python3 benchmarks/publish_gpu.py $old_syncs --mem-syncs 0 --out "$OUT/nounit/8b"
  [ -n "$old" ] && run syncs_8b_old ${SYNCS_LIMIT:-150} bash -c 'old_tree "$@"' old python3 benchmarks/publish_gpu.py $old_syncs --out "$OUT/old/8b"
  run syncs_moe12 ${SYNCS_LIMIT:-150} python3 benchmarks/publish_gpu.py $syncs $moe --out "$OUT" --name syncs_moe12
  [ -n "$old" ] && run syncs_moe12_old ${SYNCS_LIMIT:-150} bash -c 'old_tree "$@"' old python3 benchmarks/publish_gpu.py $old_syncs $moe --out "$OUT/old/moe12"
  if [ "$n" -ge 2 ]; then
    run stage_tp ${TP_LIMIT:-420} python3 benchmarks/stage_tp.py --models qwen3-8b,qwen3-30b-a3b --tp 1,2 --out "$OUT"
    run stage_tp_plain ${TP_LIMIT:-420} python3 benchmarks/stage_tp.py --models qwen3-8b,qwen3-30b-a3b --tp 1,2 --layout plain --out "$OUT"
  else echo "== stage_tp (TP=2 on two GPUs): skipped: this host has $n GPU"; fi
  if [ "$n" -ge 4 ]; then
    run syncs_moe48 ${MOE48_LIMIT:-420} python3 benchmarks/publish_gpu.py $syncs --model qwen3-30b-a3b --world 2 --engine-gpu 2 --out "$OUT" --name syncs_moe48
    [ -n "$old" ] && run syncs_moe48_old ${MOE48_LIMIT:-420} bash -c 'old_tree "$@"' old python3 benchmarks/publish_gpu.py $old_syncs --model qwen3-30b-a3b --world 2 --engine-gpu 2 --out "$OUT/old/moe48"
  else echo "== syncs_moe48 (the whole 30B-A3B at W=2, engine on a third card): skipped: this host has $n GPU"; fi
  python3 benchmarks/issue35_summary.py "$OUT" | tee "$OUT/issue35_summary.log"
}
memory35() {  # the publish's device memory (issue 35 item 6): nvCOMP's compression space by batch, then the
  # bounded options (UploadOptions(gpu_encode_frames), DetectOptions(stream_pass_elems=2^30)) at 8B, a few syncs
  run nvcomp_temp 120 python3 benchmarks/nvcomp_temp.py
  run mem_8b_bounded ${SYNCS_LIMIT:-150} python3 benchmarks/publish_gpu.py --codecs chunked:gpu --steps 3 --warmup 1 --mem-syncs 2 --encode-frames ${ENCODE_FRAMES:-256} --stream-pass-elems 1073741824 --out "$OUT/mem" --name mem_8b_bounded
}
for stage in ${STAGES:-tests publish apply world2}; do
  case $stage in
    tests)   run pytest_gpu ${TESTS_LIMIT:-200} python3 -m pytest -q -m gpu tests/apply tests/trainer tests/codec/test_codec_gpu.py tests/codec/test_codec_kernels.py --maxfail=20 -p no:cacheprovider ;;
    calls)   run codec_calls ${CALLS_LIMIT:-200} python3 benchmarks/codec_calls.py --out "$OUT" ${CALLS_ARGS:-} ;;
    codec)   run codec_gpu 300 python3 benchmarks/codec_gpu.py --out "$OUT" ${CODEC_ARGS:-} ;;
    moe)     run publish_moe ${MOE_LIMIT:-300} python3 benchmarks/publish_gpu.py --model qwen3-30b-a3b --layers 12 --steps 4 --codecs chunked:gpu --out "$OUT/moe" ${MOE_ARGS:-} ;;
    publish) run publish_w1 ${PUBLISH_LIMIT:-330} python3 benchmarks/publish_gpu.py --out "$OUT" ${PUBLISH_ARGS:-} ;;
    publish_torch) run publish_w1_torch 180 python3 benchmarks/publish_gpu.py --backend torch --codecs chunked:gpu --out "$OUT/torch" ${PUBLISH_ARGS:-} ;;
    world2)  run publish_w2 ${WORLD_LIMIT:-420} python3 benchmarks/publish_gpu.py --world 2 --codecs compact,chunked:gpu --out "$OUT" ${PUBLISH_ARGS:-} ;;
    world4)  run publish_w4 ${WORLD_LIMIT:-420} python3 benchmarks/publish_gpu.py --world 4 --codecs chunked:gpu --out "$OUT" ${PUBLISH_ARGS:-} ;;
    open)    run open_parts ${OPEN_LIMIT:-180} python3 benchmarks/open_parts.py ${OPEN_STORES:-/dev/shm/open} ;;
    worlds)  run publish_worlds ${WORLDS_LIMIT:-600} python3 benchmarks/publish_gpu.py --world 1,2,4 --codecs chunked:gpu --steps 3 --warmup 1 --out "$OUT" ${PUBLISH_ARGS:-} ;;
    worlds3) run publish_worlds3 ${WORLDS_LIMIT:-600} python3 benchmarks/publish_gpu.py --world 1,2,4 --codecs chunked:gpu --steps 3 --warmup 1 ${PUBLISH_ARGS:-} ${WORLDS3_ARGS:-} --header-format 3 --out "$OUT/f3" --store /dev/shm/open3 ;;
    tp2)     run stage_tp ${TP_LIMIT:-420} python3 benchmarks/stage_tp.py --models qwen3-8b,qwen3-30b-a3b --tp 1,2 --out "$OUT" ${TP_ARGS:-}
             run stage_tp_parts ${TP_LIMIT:-420} python3 benchmarks/stage_tp.py --models qwen3-8b --tp 1,2 --parts 2 --out "$OUT/parts" ${TP_ARGS:-} ;;
    undo)    run undo_gpu ${UNDO_LIMIT:-300} python3 benchmarks/undo_gpu.py --models qwen3-8b --densities 0.01 --out "$OUT" ${UNDO_ARGS:-} ;;
    apply)   run apply_gpu ${APPLY_LIMIT:-420} python3 benchmarks/apply_gpu.py --models qwen3-8b,qwen3-30b-a3b --densities 0.01,0.03 --out "$OUT" ${APPLY_ARGS:-} ;;
    moe48)   run publish_moe48 ${MOE48_LIMIT:-420} python3 benchmarks/publish_gpu.py --model qwen3-30b-a3b --world 2 --engine-gpu 2 --codecs chunked:gpu --steps ${MOE48_STEPS:-2} --warmup 1 --out "$OUT/moe48" ;;
    oldmoe48) run publish_moe48_old ${MOE48_LIMIT:-420} bash -c 'old_tree "$@"' old python3 benchmarks/publish_gpu.py --model qwen3-30b-a3b --world 2 --engine-gpu 2 --codecs chunked:gpu --steps ${MOE48_STEPS:-2} --warmup 1 --out "$OUT/moe48_old" ;;
    old)     run publish_w1_old ${OLD_LIMIT:-240} bash -c 'old_tree "$@"' old python3 benchmarks/publish_gpu.py --codecs chunked:gpu --out "$OUT/old" ${PUBLISH_ARGS:-} ;;
    oldmoe)  run publish_moe_old ${MOE_LIMIT:-300} bash -c 'old_tree "$@"' old python3 benchmarks/publish_gpu.py --model qwen3-30b-a3b --layers 12 --steps 4 --codecs chunked:gpu --out "$OUT/moe_old" ${MOE_ARGS:-} ;;
    profile) run profile_stage ${PROFILE_LIMIT:-300} python3 benchmarks/profile_stage.py --model ${PROFILE_MODEL:-qwen3-8b} ${PROFILE_ARGS:-} ;;
    profsync) run profile_sync ${PROFILE_LIMIT:-300} python3 benchmarks/profile_sync.py --model ${PROFILE_MODEL:-qwen3-8b} ${PROFILE_ARGS:-} ;;
    trainer) run trainer_gpu 120 python3 benchmarks/trainer_gpu.py --out "$OUT" ;;
    detect)  run detect_gpu 300 python3 benchmarks/detect_gpu.py --out "$OUT" ${DETECT_ARGS:-} ;;
    issue35) issue35 ;;
    memory35) memory35 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "== fallbacks and failures logged (none is the expected outcome):"
grep -h "failed\|falls back\|MISMATCH\|Traceback" "$OUT"/*.log "$OUT"/*/*.log 2>/dev/null | grep -v "^FAILED tests" | sort | uniq -c | head -20
