#!/usr/bin/env bash
# The default model's GGUF (94 MiB) is more than one device call may carry (64 MiB), so it travels
# in two halves, one call each.  A carried folder does not survive the next call that carries
# another, so the first call copies its half out of the repo; the machine must still be warm
# (it is released after ~30 s idle), then `dev/gpu_run.sh demo` joins the halves.  Run here,
# then on the device, back to back:
#   run(carry=[".model-a"], command="cp .model-a/part /tmp/model-a-part")
#   run(carry=[".model-b"], command="bash dev/gpu_run.sh demo")
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(python3 -c "from nvfp4_backend.eval.models import default_model_path; print(default_model_path())")
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
rm -rf .model-a .model-b && mkdir -p .model-a .model-b
head -c "$half" "$gguf" > .model-a/part
tail -c +"$(( half + 1 ))" "$gguf" > .model-b/part
python3 -m pip download -q --no-deps gguf -d .model-b   # the GGUF reader transformers needs
sha256sum "$gguf" | cut -d' ' -f1 > .model-b/sha256
grep -qx '/.model-a/' .git/info/exclude || printf '/.model-a/\n/.model-b/\n' >> .git/info/exclude
du -sh .model-a .model-b
