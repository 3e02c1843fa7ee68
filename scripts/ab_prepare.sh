#!/usr/bin/env bash
# A same-machine A/B of a Python-level change (the extension unchanged): puts pk_jax/ of commit $1 into .ab/<sha>/
# (ignored by git: pass it in the device call's carry, beside .prebuilt), for the `abpy` stage of
# scripts/device_session.sh, which runs the bench from there (old) and from the tree (new) in alternating turns.
#   bash scripts/ab_prepare.sh 7d8ac45        # prints the directory and the full sha for AB_DIR / AB_COMMIT
set -euo pipefail
cd "$(dirname "$0")/.."
sha=$(git rev-parse "${1:?usage: scripts/ab_prepare.sh <commit>}^{commit}")
dir=.ab/${sha:0:7}
rm -rf "$dir" && mkdir -p "$dir"
git archive "$sha" pk_jax | tar -x -C "$dir"
echo "AB_DIR=$dir AB_COMMIT=$sha"
