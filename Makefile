# mtcfs — make demo shows it working, make test is what CI runs.
GO        ?= go
BIN       := bin/mtcfs
GOFLAGS   ?=
TEST_TIMEOUT ?= 15m

.PHONY: all build demo test vet bench fuzz proto clean check-mounts clean-test-mounts

all: build

build:
	$(GO) build -o $(BIN) ./cmd/mtcfs

demo: build
	@[ "$$(id -u)" = 0 ] || { echo "make demo mounts FUSE and a tmpfs: run it as root"; exit 1; }
	$(GO) run ./cmd/demo -mtcfs $(BIN)

vet:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { echo "gofmt needed:"; gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...

# The whole suite under the race detector, then the concurrency tests again on one P, then a
# check that no test left a mount behind. Tests unmount what they mount, also when they fail;
# a test binary killed by -timeout cannot, so its leftovers (mounts under a test's temporary
# directory) are detached lazily before the check, and the check then reports them.
test: vet
	@status=0; \
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./... || status=$$?; \
	if [ $$status = 0 ]; then GOMAXPROCS=1 $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) -run 'Concurrent|Stress|Early|SlowPeer|CoordinatorSync' ./... || status=$$?; fi; \
	$(MAKE) --no-print-directory clean-test-mounts; \
	$(MAKE) --no-print-directory check-mounts || status=1; \
	exit $$status

# Test mounts live under the temporary directories go test makes (/tmp/Test*, /tmp/mtcfs-*).
clean-test-mounts:
	@awk '($$3 == "fuse.mtcfs" || $$1 == "mtcfs-spool") && $$2 ~ "^$(or $(TMPDIR),/tmp)/(Test|mtcfs-)" {print $$2}' /proc/mounts | \
		while read -r m; do echo "detaching leftover test mount $$m"; umount -l "$$m" || true; done

check-mounts:
	@if awk '($$3 == "fuse.mtcfs" || $$1 == "mtcfs-spool") && $$2 ~ "^$(or $(TMPDIR),/tmp)/(Test|mtcfs-)"' /proc/mounts | grep .; then echo "tests left mounts behind"; exit 1; fi

bench: build
	$(GO) run ./bench/fsbench -mtcfs $(BIN) -out bench/RESULTS.md

# The peer protocol's generated code is committed; regenerate after editing peer.proto
# (needs protoc and the protoc-gen-go / protoc-gen-go-grpc plugins, see replication/doc.go).
proto:
	protoc --proto_path=replication/peerpb --go_out=replication/peerpb --go_opt=paths=source_relative \
		--go-grpc_out=replication/peerpb --go-grpc_opt=paths=source_relative \
		replication/peerpb/peer.proto replication/peerpb/coordinator.proto

fuzz:
	$(GO) test ./tiers -run '^$$' -fuzz FuzzParseConfig -fuzztime 60s

clean:
	rm -rf bin
