package replication

import (
	"testing"

	"github.com/mtcfs/mtcfs/internal/faultproxy"
)

// newFaultProxy puts a fault-injecting TCP proxy (package internal/faultproxy) in front of
// target for the test's lifetime: dial its Addr instead of target. Bit flips land only in the
// payload of HTTP/2 DATA frames, the bytes that carry gRPC messages.
func newFaultProxy(t *testing.T, target string) *faultproxy.Proxy {
	t.Helper()
	p, err := faultproxy.New("127.0.0.1:0", target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}
