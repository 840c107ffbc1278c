#!/bin/sh
# Lays out in DIR the build context of Containerfile.prebuilt: the agent built static
# (CGO_ENABLED=0, so it needs no libc in the image) and the build machine's CA certificates
# (the agent verifies storage.googleapis.com for gs:// backups). make image and the deploy
# tests both use it, so the tests run what the image holds.
set -eu
dir=${1:?usage: stage-image.sh DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
certs=/etc/ssl/certs/ca-certificates.crt
if [ ! -r "$certs" ]; then
	echo "stage-image.sh: $certs is missing: install the CA certificates (apt-get install ca-certificates); gs:// backups need them" >&2
	exit 1
fi
mkdir -p "$dir"
(cd "$root" && CGO_ENABLED=0 ${GO:-go} build -trimpath -ldflags='-s -w' -o "$dir/mtcfs" ./cmd/mtcfs)
cp "$certs" "$dir/ca-certificates.crt"
