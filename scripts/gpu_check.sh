#!/usr/bin/env bash
# brigade on NVIDIA GPUs: the device's own profile (calibrate), the single-device study (and its MFU), and
# with 4+ GPUs the dp_vs_3d study. Every run ends in a record (results/<study>.jsonl), like any other run.
#
#   scripts/gpu_check.sh                      # HW=h100_sxm: the profile whose peak TFLOPs MFU uses
#   HW=a100_80g scripts/gpu_check.sh          # a100_80g | h100_sxm | h200 (conf/hardware/)
#   COMPILE=true scripts/gpu_check.sh         # also with torch.compile (workload.compile=true)
#   CALIBRATE=false scripts/gpu_check.sh      # skip step 0 (about 2 minutes)
#   LLAMA=false scripts/gpu_check.sh          # skip the 8-block Llama 3 8B run (about 1-2 minutes)
#   HW=cpu scripts/gpu_check.sh               # a rehearsal on this CPU: every step that needs no CUDA, with
#                                             # model=tiny in fp32 (make test-all runs it: tests/test_gpu_scripts.py)
#
# The python: $PY if set; else .venv's (install your CUDA build of torch before `make install`: see README);
# else, on a GPU machine that reaches no package registry, python3's own CUDA torch with the wheels that
# scripts/gpu_wheels.sh made where pip works (.whl/, copied along). For the NVML memory reading it needs
# nvidia-ml-py (installed if missing and pip reaches a registry; left out if not). What it runs:
#   0. python -m harness.calibrate hardware=$HW on cuda:0 (harness/tools/calibrate_gpu.py): GEMMs by shape
#      after a soak, memory and element-wise bandwidth, the fused attention's forward and backward ->
#      conf/hardware/local/${HW}_measured.yaml, printed beside the cited profile's figures
#   1. gpu_single: strategy=single, bf16-mixed, model gpt2_124m and gpt_1_3b, and a Llama 3 8B cut to 8 of
#      its 32 blocks (its GEMM shapes, GQA, SwiGLU, RMSNorm, RoPE at s=8192: the eager Llama stack whose H100
#      throughput the model over-predicts, docs/published.md); 10 timed steps each, step time from CUDA
#      events, peak memory from max_memory_allocated/reserved and NVML, comm 0; 2 profiled steps split
#      the compute into GEMM, attention, element-wise and optimizer kernels (harness/collect/compute_classes.py)
#   2. with 4 or more GPUs: experiment=dp_vs_3d on this hardware (NCCL; comm share from NCCL kernels)
#   3. the tables: step time, tokens/s, MFU, memory; measured/predicted ratios (harness.collect.aggregate)
#      and the compute by kind of work, measured beside predicted (python -m harness.fidelity prints both),
#      and the single-device steps predicted again on the measured profile of step 0
#   5. the profiled steps' own traces, per rank and step (python -m harness.trace: compute by kind, NCCL
#      collectives with their bus bandwidth, overlap, idle), and Holistic Trace Analysis's figures beside
#      brigade's (python -m lab.trace_vs_hta) where HTA is installed (make install puts it in .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ] && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
elif [ -z "${PY:-}" ] && [ -f "${WHEELS:=.whl}/requirements.txt" ]; then
  # pip resolves brigade's roots against python3's own packages and names what is missing or refused by a
  # pin; only those go, from .whl/, into a folder of their own on PYTHONPATH: python3's environment (its
  # torch, numpy, CUDA libraries) is not changed
  PY=python3
  SITE=${SITE:-/tmp/brigade-site}
  $PY -m pip install -q --no-index --find-links "$WHEELS" --dry-run --report "$SITE.json" -r "$WHEELS/requirements.txt"
  NEED=$($PY - "$SITE.json" <<'EOF'
import json, sys
print(" ".join(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.load(open(sys.argv[1]))["install"]))
EOF
)
  [ -z "$NEED" ] || $PY -m pip install -q --no-index --find-links "$WHEELS" --no-deps --target "$SITE" $NEED
  # Holistic Trace Analysis for step 5, --no-deps as `make install` installs it (requirements-nodeps.txt)
  if [ -f "$WHEELS/requirements-nodeps.txt" ] && ! PYTHONPATH="$SITE" $PY -c "import hta" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links "$WHEELS" --no-deps --target "$SITE" -r "$WHEELS/requirements-nodeps.txt"
    NEED="$NEED $(tr '\n' ' ' <"$WHEELS/requirements-nodeps.txt")"
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "== python3 $($PY -c 'import sys; print(sys.version.split()[0])'); from $WHEELS/ into $SITE: ${NEED:-nothing}"
fi
[ -n "${PY:-}" ] || { echo "no .venv/bin/python and no .whl/: run 'make install' (after installing a CUDA torch), or scripts/gpu_wheels.sh where pip works and copy .whl/ here" >&2; exit 1; }
HW=${HW:-h100_sxm}
COMPILE=${COMPILE:-false}
# HW=cpu rehearses the script where there is no GPU: no device check, no calibration, model=tiny in fp32
if [ "$HW" = "cpu" ]; then
  MODELS=${MODELS:-tiny}; PRECISION=${PRECISION:-fp32}; CALIBRATE=${CALIBRATE:-false}; LLAMA=${LLAMA:-false}
fi
MODELS=${MODELS:-gpt2_124m,gpt_1_3b}
PRECISION=${PRECISION:-bf16-mixed}
RESULTS=${RESULTS:-results}
LOGGER=${LOGGER:-wandb}   # W&B offline by default; LOGGER=none for none

if ! TORCH=$($PY -c "import torch; print(torch.__version__)" 2>/dev/null); then
  echo "$PY has no torch: install a CUDA build of torch into its environment first" >&2
  exit 1
fi
NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$NGPU" -lt 1 ] && [ "$HW" != "cpu" ]; then
  echo "no CUDA device visible to torch $TORCH: install a CUDA build of torch into $PY's environment first" >&2
  exit 1
fi
if [ "$HW" = "cpu" ]; then
  echo "== rehearsal on the CPU (HW=cpu): model $MODELS, precision $PRECISION, compile=$COMPILE"
else
  $PY -c "import pynvml" 2>/dev/null || $PY -m pip install -q nvidia-ml-py==13.615.71 \
    || echo "== no nvidia-ml-py: the NVML memory and SM clock readings are left out" >&2
  echo "== $NGPU GPU(s): $($PY -c 'import torch; print(torch.cuda.get_device_name(0))'), hardware profile $HW, compile=$COMPILE"
fi

# 0. the device's own figures, beside the cited ones the predictions below use
MEASURED=""
if [ "${CALIBRATE:-true}" = "true" ]; then
  if $PY -m harness.calibrate hardware="$HW" --name "${HW}_measured"; then
    MEASURED="local/${HW}_measured"
  else
    echo "== calibrate on $HW failed (above); the study runs on the cited profile only" >&2
  fi
fi

# a run that does not end ok is in its record (and the tables below); the exit code says so at the end
FAILED=""
COMPILES=false
[ "$COMPILE" = "true" ] && COMPILES=false,true
# 1. one device. global batch 8 in micro-batches of 4 (gpt_1_3b at s=2048 fits 80 GB with room);
#    the sweep crosses the two models with compile off (and on).
$PY -m harness -m study=gpu_single hardware="$HW" strategy=single "model=$MODELS" \
  workload.precision="$PRECISION" workload.global_batch_size=8 workload.micro_batch_size=4 \
  "workload.compile=$COMPILES" logger="$LOGGER" results_dir="$RESULTS" || FAILED="$FAILED gpu_single"
# a Llama block as the published Llama runs have it: one sequence of 8192 per micro-batch, 4 per step
# (68.5 GiB predicted on 80 GB)
if [ "${LLAMA:-true}" = "true" ]; then
  $PY -m harness -m study=gpu_single hardware="$HW" strategy=single model=llama3_8b model.n_layers=8 \
    workload.precision=bf16-mixed workload.global_batch_size=4 workload.micro_batch_size=1 \
    "workload.compile=$COMPILES" logger="$LOGGER" results_dir="$RESULTS" || FAILED="$FAILED gpu_single(llama)"
fi

# 2. several devices: the parallel strategies side by side (world 4), on this hardware.
if [ "$NGPU" -ge 4 ]; then
  $PY -m harness experiment=dp_vs_3d hardware="$HW" logger="$LOGGER" results_dir="$RESULTS" || FAILED="$FAILED dp_vs_3d"
else
  echo "== $NGPU GPU(s): dp_vs_3d needs 4, skipped"
fi

# 3. the numbers
$PY - "$RESULTS" <<'PYEOF'
import sys
from pathlib import Path
from harness.run.results_file import latest_by_run_id, read
for study in ("gpu_single", "dp_vs_3d"):
    path = Path(sys.argv[1]) / f"{study}.jsonl"
    if not path.exists():
        continue
    print(f"\n{study}: strategy model compile | step s (p10-p90) | tokens/s | MFU % | peak alloc GiB | NVML GiB | comm %")
    for r in latest_by_run_id(read(path)).values():
        c, m = r["config"], r["measured"]
        if r["status"] != "ok":
            print(f"  {r['strategy']} {c['model']['name']}: {r['status']} {str(r.get('error'))[:200]}")
            continue
        gib = lambda b: f"{b / 2**30:.1f}" if b else "-"
        print(f"  {r['strategy']} {c['model']['name']} {c['workload'].get('compile')} | {m['step_time_s']:.4f} "
              f"({m['step_time_s_p10']:.4f}-{m['step_time_s_p90']:.4f}) | {m['tokens_per_s']:.0f} | "
              f"{m.get('mfu_pct') or 0:.1f} | {gib(m.get('peak_mem_bytes'))} | {gib(m.get('device_mem_used_nvml_bytes'))} "
              f"| {m.get('comm_share_pct', 0):.1f}")
        for k in m.get("compute_top_kernels") or []:  # which attention backend and GEMM kernels ran
            print(f"      {k['kind']:11s} {1e3 * k['time_s']:8.2f} ms x{k['count']:.0f}  {k['name'][:90]}")
PYEOF
for study in gpu_single dp_vs_3d; do
  [ -f "$RESULTS/$study.jsonl" ] && { echo; echo "== $study: measured / predicted"; $PY -m harness.fidelity "$RESULTS/$study.jsonl"; }
done

# 4. the single-device steps predicted again on the measured profile (step 0): step 3's tables on it, so each
#    kind of work's measured / predicted stands beside the cited profile's (harness/fidelity.py --repredict)
if [ -n "$MEASURED" ] && [ -f "$RESULTS/gpu_single.jsonl" ]; then
  echo; echo "== gpu_single: measured / predicted on hardware=$MEASURED"
  $PY -m harness.fidelity "$RESULTS/gpu_single.jsonl" --repredict "hardware=$MEASURED"
fi

# 5. the profiled steps' traces: brigade's tables per rank and step, then HTA's figures beside brigade's. HTA
#    reads GPU kernels only: the rehearsal's traces are CPU ones, so it shows HTA on a public GPU trace instead.
TRACES=$(ls "$RESULTS"/runs/gpu_single/*/trace_rank*.json "$RESULTS"/runs/dp_vs_3d/*/trace_rank*.json 2>/dev/null || true)
if [ -n "$TRACES" ]; then
  echo; echo "== the profiled steps' traces (python -m harness.trace)"
  # shellcheck disable=SC2086
  $PY -m harness.trace $TRACES || FAILED="$FAILED traces"
  if ! $PY -c "import hta" 2>/dev/null; then
    echo "== HTA is not installed here (pip install --no-deps -r requirements-nodeps.txt): brigade's figures only"
  elif [ "$HW" = "cpu" ]; then
    echo; echo "== HTA beside brigade (python -m lab.trace_vs_hta) on a public GPU trace: HTA reads GPU kernels only"
    $PY -m lab.trace_vs_hta tests/fixtures/gpu_traces/nccl_data.json.gz || FAILED="$FAILED hta"
  else
    echo; echo "== HTA beside brigade (python -m lab.trace_vs_hta)"
    # shellcheck disable=SC2086
    $PY -m lab.trace_vs_hta $TRACES || FAILED="$FAILED hta"
  fi
fi
if [ -n "$FAILED" ]; then
  echo "== not every run ended ok:$FAILED (the tables above and each record's error say why)" >&2
  exit 1
fi
