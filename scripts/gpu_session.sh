#!/usr/bin/env bash
# GPU steps for the H100 proxy (see README "Running the GPU tests").  Run from the repo root on the device after
# `source /tmp/gpu-site/env.sh` (or `.gpu/p2/env.sh`).  Steps: smoke | test | bench | host | host_ab | jit | prebuilt-size | sanitize | lies | decode | all.
# jit: bench_jit.py (first call: prebuilt set built for this device's arch, warm disk, cold JIT, SDPA floor);
# prebuilt-size: the full sm_120a prebuilt set through the publish path's build, its size row (64-core host).
# decode: the decode tiles' GPU tests (key split, deep K/V pipelines, split, paged) and the A/B of decode tile tables.
# Logs go to $OUT (the device tool's folder) when set, else ./out.
set -uo pipefail
out="${OUT:-out}"; mkdir -p "$out"
export FA4_SM120_CACHE_DIR="${FA4_SM120_CACHE_DIR:-/tmp/fa4sm120-cache}"
export PYTHONUNBUFFERED=1
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
rc=0
run_step() {
  case "$1" in
    smoke) timeout 300 python3 scripts/gpu_smoke.py 2>&1 | tee "$out/smoke.log" ;;
    test) timeout 540 python3 -m pytest -m gpu -q -n "${FA4_TEST_JOBS:-12}" --timeout 300 -p no:cacheprovider \
            --junitxml="$out/junit.xml" tests 2>&1 | tail -n 150 | tee "$out/test.log" ;;
    bench) timeout 540 python3 benchmarks/bench_fwd.py --out "$out/fwd_bench.jsonl" 2>&1 | tee "$out/bench.log" ;;
    host) timeout 300 python3 benchmarks/bench_host.py --out "$out/host_bench.jsonl" 2>&1 | tee "$out/host.log" ;;
    jit) timeout 540 python3 benchmarks/bench_jit.py --build-prebuilt /tmp/fa4-prebuilt \
           --jobs "$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))" --out "$out/first_call_h100.jsonl" 2>&1 | tee "$out/jit.log" ;;
    prebuilt-size) timeout 540 python3 scripts/build_bundle.py --prebuilt --arch sm_120a \
           --jobs "$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))" --out /tmp/fa4-prebuilt-sm120a \
           --report "$out/prebuilt_size.jsonl" 2>&1 | tail -n 20 | tee "$out/prebuilt_size.log" ;;
    # new/old host cost (issue 32): needs _hostbase/ (aa0de83's package renamed flash_attn_4_sm120_base) carried
    host_ab) timeout 420 python3 benchmarks/bench_host_ab.py --blocks 1000 --calls 10 --out "$out/host_ab_gpu.jsonl" \
               2>&1 | tee "$out/host_ab.log"
             timeout 150 python3 benchmarks/bench_host_ab.py --cpu --blocks 1000 --calls 10 \
               --out "$out/host_ab_cpu.jsonl" 2>&1 | tee -a "$out/host_ab.log" ;;
    decode) timeout 300 python3 -m pytest -m gpu -q -n "${FA4_TEST_JOBS:-12}" --timeout 300 -p no:cacheprovider \
              tests/test_decode_gpu.py tests/test_split_gpu.py tests/test_paged_gpu.py tests/test_kvcache_gpu.py \
              2>&1 | tail -n 60 \
              | tee "$out/decode_test.log"
            timeout 200 python3 benchmarks/experiments/probe_decode_tiles.py \
              --variants rows64 keysplit deep4 deep5 deep4_all --out "$out/decode_tiles.jsonl" 2>&1 \
              | tee "$out/decode_tiles.log"
            timeout 100 python3 benchmarks/experiments/probe_decode_tiles.py \
              --only mqa --variants keysplit deep4 deep5 --splits 0 32 96 --profile --out "$out/decode_tiles.jsonl" \
              2>&1 | tee -a "$out/decode_tiles.log" ;;
    lies) SANITIZE_TIMEOUT=500 bash benchmarks/sanitize_lying_metadata.sh 2>&1 | tee "$out/sanitize_lies.log" ;;
    sanitize) timeout 540 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider \
            tests/test_fwd_gpu.py -k "varlen or seqused or zero_length" 2>&1 | tail -n 60 | tee "$out/sanitize.log" ;;
    all) for s in smoke test bench; do run_step "$s" || rc=1; done ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}
for s in "${steps[@]}"; do run_step "$s" || rc=1; done
exit $rc
