#!/usr/bin/env bash
# A/B of two builds in one device call: the tree as sent ("new") against the tree with $AB_PATCH reversed
# ("base"), both built here, then the attention GPU tests on "new" and `bench attention $BENCH_ARGS` on each, with
# cuDNN timed in each run; prints both ratios per row. Make the patch before sending the tree, e.g.
#   git diff HEAD~1 -- kernels > ab.patch      (an untracked file travels with the tree)
# Usage: AB_PATCH=ab.patch BENCH_ARGS="--cases fwd fwd_bwd --seqs 4096 --head-dims 128" bash scripts/ab_attention.sh
set -o pipefail
: "${AB_PATCH:?set AB_PATCH to the patch that turns base into new}"
O=${O:-/tmp/pkout}; mkdir -p "$O"; ROOT=$PWD
build() {  # tree, tag
  (cd "$1" && cmake -S . -B build/ab -DPython_EXECUTABLE="$(which python3)" -DCMAKE_BUILD_TYPE=Release > "$O/cmake-$2.log" 2>&1 &&
     cmake --build build/ab -j8 >> "$O/cmake-$2.log" 2>&1 && cp build/ab/_pk_jax_ext*.so pk_jax/) ||
    { echo "build $2 failed"; tail -20 "$O/cmake-$2.log"; }
}
rm -rf /tmp/basetree && cp -r . /tmp/basetree && (cd /tmp/basetree && patch -R -p1 -s < "$ROOT/$AB_PATCH") || exit 1
build "$ROOT" new & build /tmp/basetree base & wait
echo "built after $SECONDS s"
PYTHONPATH=$ROOT timeout "${TEST_S:-330}" python3 -m pytest tests/gpu/test_attention_gpu.py tests/gpu/test_attention_bwd_gpu.py \
  -m gpu -q -x -rs > "$O/tests.log" 2>&1
echo "tests rc $? after $SECONDS s"; tail -2 "$O/tests.log"
for side in new base; do
  dir=$ROOT; [ $side = base ] && dir=/tmp/basetree
  # -k: the bench turns SIGTERM into SystemExit, which waits for the Python interpreter; a hung kernel never returns.
  (cd "$dir" && PYTHONPATH=$dir timeout -k 20 "${BENCH_S:-200}" python3 -m pk_jax.bench attention $BENCH_ARGS --out "$O/ab-$side.json" \
     > "$O/bench-$side.log" 2>&1; echo "bench $side rc $? after $SECONDS s")
done
python3 - "$O" <<'PY'
import json, sys
rows = {s: {(tuple(r["shape"]), r["case"]): r for r in json.load(open(f"{sys.argv[1]}/ab-{s}.json"))["rows"]}
        for s in ("new", "base")}
for key, n in rows["new"].items():
    b = rows["base"].get(key)
    if b and n["ratio"] and b["ratio"]:
        print(key, f"new ratio {n['ratio']:.3f} base ratio {b['ratio']:.3f} | new ms {n['ours_ms']:.3f} base ms "
                   f"{b['ours_ms']:.3f} (cuDNN {n['baseline_ms']:.3f} / {b['baseline_ms']:.3f})")
PY
