#!/bin/sh
# Regenerate everything issue 8 ships: tokenizer + KJV corpus, the trained tiny model
# (models/tiny-step), the golden data (test/data/golden) and the transformers cross-check.
#   tools/reference/regenerate.sh              full run (training takes 25 min on 2 cores)
#   tools/reference/regenerate.sh --no-train   keep models/tiny-step, redo goldens + cross-check
# Needs: python3 with torch, tokenizers, safetensors, transformers; Debian bible-kjv + bible-kjv-text.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
REF="$ROOT/tools/reference"
WORK=${STEP_REF_WORK:-/tmp/step-ref-work}
mkdir -p "$WORK"
cd "$ROOT"
python3 "$REF/make_tokenizer.py" "$WORK/tok" "$WORK/corpus"
if [ "${1:-}" != "--no-train" ]; then
    python3 "$REF/train.py" --tok "$WORK/tok" --corpus "$WORK/corpus" --out models/tiny-step \
        --minutes 25 --batch 8 --threads 1 --limit 2.5 --limit-shared 4.0 --state "$WORK/state.pt"
fi
python3 "$REF/make_goldens.py" --tiny models/tiny-step --out test/data/golden \
    --heldout "$WORK/corpus/heldout.txt"
python3 "$REF/step_np.py" check-text models/tiny-step test/data/golden/tiny-step.json
python3 "$REF/step_np.py" check-text test/data/golden/random-model test/data/golden/random.json
# the whole-model image goldens need the vision tower (vision_ref.py make-tower) and PIL
if grep -q '"vision_config"' models/tiny-step/config.json; then
    python3 "$REF/step_np.py" image-goldens models/tiny-step test/data/golden/tiny-step-images.json
fi
python3 "$REF/xcheck_transformers.py" models/tiny-step test/data/golden/random-model
python3 "$REF/check_mxfp4.py" models/tiny-step
