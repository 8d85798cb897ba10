#!/usr/bin/env bash
# Builds Kueue's controller manager (sigs.k8s.io/kueue/cmd/kueue) from the Go module proxy and
# copies its CRDs and webhook manifest out of the same module, for the tests that run real Kueue
# against the local cluster (tests/harness/kueue.py, `make cluster-up KUEUE=1`).
#
# Why build: Kueue publishes container images and Helm charts, not binaries, and this project runs
# no containers. `go install <pkg>@<version>` builds it with Kueue's own go.mod (it has no
# replace directives), verified against the checksum database; no Kueue source lives here.
#
# Idempotent: everything goes to a cache directory outside the work tree keyed by the version
# ($RTJ_KUEUE, default ~/.cache/rtj-testbin/kueue-<version>); a warm cache returns at once.
# Prints the directory on its last line:
#   kueue                   the controller manager (version-stamped as upstream's Makefile does)
#   crds/*.yaml             config/components/crd/bases of the module (no conversion webhooks)
#   webhook-manifests.yaml  config/components/webhook/manifests.yaml of the module
set -euo pipefail
KUEUE=v0.17.0
OUT=${RTJ_KUEUE:-${XDG_CACHE_HOME:-$HOME/.cache}/rtj-testbin/kueue-$KUEUE}

have() {
  [[ -x $OUT/kueue && -f $OUT/webhook-manifests.yaml && -f $OUT/crds/kueue.x-k8s.io_workloads.yaml ]]
}
if have; then echo "$OUT"; exit 0; fi

log() { printf '[build-kueue %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
command -v go >/dev/null || { echo "build-kueue: 'go' (>= 1.25) is required on PATH" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$OUT"
t0=$SECONDS
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

if [[ ! -x $OUT/kueue ]]; then
  log "building kueue $KUEUE (cold build measured: ~4.5 min on 2 cores, docs/development.md)"
  version=sigs.k8s.io/kueue/pkg/version
  GOBIN=$tmp/bin go install -trimpath \
    -ldflags "-s -w -X '$version.GitVersion=$KUEUE' -X '$version.BuildDate=1970-01-01T00:00:00Z'" \
    "sigs.k8s.io/kueue/cmd/kueue@$KUEUE"
  # The build info names the module and version it was built from: check it is the pinned one.
  go version -m "$tmp/bin/kueue" | grep -Eq "^[[:space:]]+mod[[:space:]]+sigs.k8s.io/kueue[[:space:]]+$KUEUE[[:space:]]" \
    || { echo "build-kueue: the binary is not sigs.k8s.io/kueue $KUEUE" >&2; exit 1; }
  install -m 0755 "$tmp/bin/kueue" "$OUT/kueue.partial" && mv "$OUT/kueue.partial" "$OUT/kueue"
  log "kueue done after $((SECONDS - t0)) s"
fi

# The manifests come from the module source `go install` just verified (in the module cache).
src=$(go mod download -json "sigs.k8s.io/kueue@$KUEUE" | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
rm -rf "$OUT/crds.partial" && mkdir -p "$OUT/crds.partial"
cp "$src"/config/components/crd/bases/*.yaml "$OUT/crds.partial/"
chmod -R u+w "$OUT/crds.partial"
rm -rf "$OUT/crds" && mv "$OUT/crds.partial" "$OUT/crds"
install -m 0644 "$src/config/components/webhook/manifests.yaml" "$OUT/webhook-manifests.partial"
mv "$OUT/webhook-manifests.partial" "$OUT/webhook-manifests.yaml"
log "kueue $KUEUE ready in $OUT after $((SECONDS - t0)) s"
echo "$OUT"
