# mtcfs — make demo shows it working, make test is what CI runs.
GO        ?= go
BIN       := bin/mtcfs
GOFLAGS   ?=
TEST_TIMEOUT ?= 15m
# pjdfstest (fs/pjdfstest_test.go) runs on its own, without -race: the suite forks several
# processes per assertion, and under -race beside the other packages it took over 15 min on a
# 2-CPU VM with slow fork+exec (about 4.5 ms each). The race pass runs the same fs code.
PJD_TIMEOUT ?= 20m
# make test runs it on the default data path (passthrough); make pjdfstest on both.
PJD_PATHS ?= on

.PHONY: all build install demo test vet bench fuzz proto clean check-mounts clean-test-mounts image pjdfstest

all: build

# The version the agent logs and `mtcfs version` prints: the commit, "-dirty" with changes.
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)

build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/mtcfs

# Puts mtcfs on PATH: /usr/local/bin as root; PREFIX=$$HOME/.local for a user (~/.local/bin).
PREFIX ?= /usr/local
install: build
	install -D -m 0755 $(BIN) $(PREFIX)/bin/mtcfs

demo: build
	@[ "$$(id -u)" = 0 ] || { echo "make demo mounts FUSE and a tmpfs: run it as root"; exit 1; }
	$(GO) run ./cmd/demo -mtcfs $(BIN)

# The modules beside the agent's: bench/ (the benchmarks, and the GCS emulator gcsbench runs in
# process) and deploy/ (manifests, image, pods). Each has its own go.mod, so that the agent's
# module requires neither; make vet and make test cover all of them.
MODULES := bench deploy

vet:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { echo "gofmt needed:"; gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...
	@for m in $(MODULES); do echo "(cd $$m && $(GO) vet ./...)"; (cd $$m && $(GO) vet ./...) || exit 1; done

# The whole suite under the race detector (but pjdfstest), then the concurrency tests again on one
# P, then pjdfstest in the mount on both data paths without -race, then the
# other modules' tests (bench: its helpers; deploy: manifests, image, pods in mount namespaces),
# then a check that no test left a mount behind. The other modules' packages run one at a time
# (-p 1): two deploy packages each build the image's static agent, and on a cold build cache two
# such builds side by side took 5 minutes where one after the other reuses the first's work.
# Tests unmount what they mount, also when they fail; a test binary killed by -timeout cannot,
# so its leftovers (mounts under a test's temporary directory) are detached lazily, named, and
# fail the run (they only printed a line before), as does a mount the detach could not remove.
# Each run has a temporary directory of its own (TMPDIR, mode 1777 as /tmp, for the tests whose
# processes run as other users; its path resolved, so that it reads as /proc/mounts shows it),
# and the sweep and the check look only there: two runs on one machine (a CI run beside a
# developer's) detached each other's live mounts under /tmp, and both failed. There every mount
# is the run's, of any type. The directory is removed when no mount is left in it; a run
# interrupted (Ctrl-C, SIGTERM) sweeps it first and keeps it, and its .owner names the run's
# shell, so that a sweep run by hand takes it once that is gone.
test: vet
	@base=$$(realpath -e "$(or $(TMPDIR),/tmp)") && run=$$(mktemp -d "$$base/make-test.XXXXXX") && \
	chmod 1777 "$$run" && echo $$$$ > "$$run/.owner" || exit 1; \
	export TMPDIR="$$run"; echo "make test: temporary files in $$run"; \
	trap '$(MAKE) --no-print-directory clean-test-mounts TEST_RUN="$$run"; echo "make test: interrupted; $$run kept"; exit 130' INT TERM; \
	status=0; \
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) -skip '^TestPjdfstest$$' ./... || status=$$?; \
	if [ $$status = 0 ]; then GOMAXPROCS=1 $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) -run 'Concurrent|Stress|Early|SlowPeer|CoordinatorSync|Yield|Pacer|RePush|TriedAgain' ./... || status=$$?; fi; \
	$(GO) test -count=1 -timeout $(PJD_TIMEOUT) -run '^TestPjdfstest$$/^$(PJD_PATHS)$$' ./fs || status=$$?; \
	for m in $(MODULES); do (cd $$m && $(GO) test -p 1 -race -count=1 -timeout $(TEST_TIMEOUT) ./...) || status=$$?; done; \
	left=$$($(MAKE) --no-print-directory clean-test-mounts TEST_RUN="$$run"); \
	if [ -n "$$left" ]; then echo "$$left"; echo "make test: tests left mounts behind (detached now): a test must unmount what it mounts, also when it fails"; status=1; fi; \
	if $(MAKE) --no-print-directory check-mounts TEST_RUN="$$run"; then rm -rf --one-file-system "$$run"; else status=1; fi; \
	exit $$status

# pjdfstest on both data paths (passthrough and the fallback), verbose: the figures of
# bench/RESULTS.md's POSIX conformance section.
pjdfstest:
	$(GO) test -count=1 -timeout $(PJD_TIMEOUT) -run '^TestPjdfstest$$' -v ./fs

# With TEST_RUN (make test's own directory) every mount under it is the run's. Otherwise (the
# targets run by hand) test mounts live under the temporary directories go test makes
# ($TMPDIR/Test*, $TMPDIR/mtcfs-*) and in make test runs' directories whose shell is gone (an
# interrupted run). A mount under $TMPDIR/mtcfs-* that a running process names as one of its
# arguments (an agent: mtcfs mount DIR --spool S) is not a leftover: a crashbench, a demo or a
# developer's agent runs there beside the tests, and detaching its mounts broke it (three
# crashbench "violations" in one session were this sweep). Under Test* every mount is a test's:
# one still served (a test binary killed with its agents running) is a leak, detached and reported.
TEST_BASE = $(patsubst %/,%,$(or $(TMPDIR),/tmp))
# /proc/mounts writes a space, tab, newline or backslash of a path as an octal escape (\040):
# unesc gives the path back, so that a TMPDIR with a space in it is swept and checked too.
UNESCAPE = function unesc(s,  o) { o = ""; while (match(s, /\\[0-7][0-7][0-7]/)) { o = o substr(s, 1, RSTART - 1) sprintf("%c", substr(s, RSTART + 1, 1) * 64 + substr(s, RSTART + 2, 1) * 8 + substr(s, RSTART + 3, 1)); s = substr(s, RSTART + 4) } return o s }
TEST_MOUNTS = if [ -n "$(TEST_RUN)" ]; then \
		awk -v d="$(TEST_RUN)/" '$(UNESCAPE) index(unesc($$2), d) == 1 {print unesc($$2)}' /proc/mounts | sort -r; \
	else \
		awk '$(UNESCAPE) ($$3 == "fuse.mtcfs" || $$1 == "mtcfs-spool") && index(unesc($$2), "$(TEST_BASE)/") == 1 && substr(unesc($$2), length("$(TEST_BASE)/") + 1) ~ /^(Test|mtcfs-|make-test\.)/ {print unesc($$2)}' /proc/mounts | \
		while read -r m; do \
			case "$$m" in \
			"$(TEST_BASE)"/mtcfs-*) \
				for c in /proc/[0-9]*/cmdline; do cat "$$c" 2>/dev/null | tr '\0' '\n' | grep -qxF -- "$$m" && continue 2; done;; \
			"$(TEST_BASE)"/make-test.*) \
				r=$${m\#"$(TEST_BASE)"/}; p=$$(cat "$(TEST_BASE)/$${r%%/*}/.owner" 2>/dev/null); \
				[ -n "$$p" ] && kill -0 "$$p" 2>/dev/null && continue;; \
			esac; \
			echo "$$m"; \
		done; \
	fi

clean-test-mounts:
	@$(TEST_MOUNTS) | while read -r m; do echo "detaching leftover test mount $$m"; umount -l "$$m" || true; done

check-mounts:
	@if $(TEST_MOUNTS) | grep .; then echo "tests left mounts behind"; exit 1; fi

# The agent's image, built offline: the static agent and the CA certificates on an empty root
# (deploy/Containerfile.prebuilt), by buildah or podman. Not part of make test. With registry
# access, deploy/Containerfile builds the same image in a golang stage (deploy/README.md).
IMAGE ?= mtcfs:dev
image:
	@tool=$$(command -v buildah || command -v podman) || { \
		echo "make image: neither buildah nor podman is installed; it needs one of them to build an image without pulling anything (apt-get install buildah)."; \
		echo "With registry access: docker build -f deploy/Containerfile -t $(IMAGE) ."; exit 1; }; \
	rm -rf deploy/.image && GO=$(GO) sh deploy/stage-image.sh deploy/.image && \
	$$tool build -f deploy/Containerfile.prebuilt -t $(IMAGE) deploy/.image && \
	echo "built $(IMAGE) with $$tool: $$($$tool images --format '{{.Size}}' $(IMAGE) | head -n1)"

# The benchmarks are a module of their own (bench/go.mod): they run from there.
bench: build
	cd bench && $(GO) run ./fsbench -mtcfs ../$(BIN) -out RESULTS.md

# The peer and coordinator protocols' generated code is committed; regenerate after editing a
# .proto (needs protoc and the protoc-gen-go / protoc-gen-go-grpc plugins, see replication/doc.go).
proto:
	protoc --proto_path=replication/peerpb --go_out=replication/peerpb --go_opt=paths=source_relative \
		--go-grpc_out=replication/peerpb --go-grpc_opt=paths=source_relative \
		replication/peerpb/peer.proto replication/peerpb/coordinator.proto
	$(GO) run golang.org/x/tools/cmd/goimports@v0.41.0 -w replication/peerpb

fuzz:
	$(GO) test ./tiers -run '^$$' -fuzz FuzzParseConfig -fuzztime 60s

clean:
	rm -rf bin
