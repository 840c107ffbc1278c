# mtcfs — make demo shows it working, make test is what CI runs.
GO        ?= go
BIN       := bin/mtcfs
GOFLAGS   ?=
TEST_TIMEOUT ?= 15m

.PHONY: all build demo test vet bench fuzz clean check-mounts

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
# check that no test left a mount behind.
test: vet
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./...
	GOMAXPROCS=1 $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) -run 'Concurrent' ./...
	@$(MAKE) --no-print-directory check-mounts

check-mounts:
	@if grep -E ' fuse\.mtcfs |mtcfs-spool' /proc/mounts; then echo "tests left mounts behind"; exit 1; fi

bench: build
	$(GO) run ./bench/fsbench -mtcfs $(BIN) -out bench/RESULTS.md

fuzz:
	$(GO) test ./tiers -run '^$$' -fuzz FuzzParseConfig -fuzztime 60s

clean:
	rm -rf bin
