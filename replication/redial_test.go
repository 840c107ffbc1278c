package replication

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/emptypb"
)

// TestRedialOfAPeerThatIsDownStaysFrequent: a connection to a peer that keeps failing (here
// every connection is closed at once) is tried again at least every redialMax (with gRPC's
// jitter), however long it has failed. gRPC's default backoff grows to 120 s: ranks that waited
// minutes for rank 0's agent to come back reached it 40 to 125 s after it did, and their jobs
// gave up at their 300 s restore wait (a black-box run). Between 25 s and 45 s of failing, the
// default tries at most twice (about 26 s and 43 s, ±20 % each); the capped backoff at least
// three times.
func TestRedialOfAPeerThatIsDownStaysFrequent(t *testing.T) {
	if testing.Short() {
		t.Skip("45 s of redials")
	}
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	start := time.Now()
	var late atomic.Int32 // connections tried between 25 s and 45 s
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if since := time.Since(start); since >= 25*time.Second && since < 45*time.Second {
				late.Add(1)
			}
			c.Close() // a peer that fails every connection
		}
	}()
	conn, err := grpc.NewClient(ln.Addr().String(), append(DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	for time.Since(start) < 45*time.Second {
		// Calls keep the connection wanted, as the coordinator's retries do.
		ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		conn.Invoke(ctx, "/mtcfs.test/Nothing", &emptypb.Empty{}, &emptypb.Empty{})
		cancel()
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("%d tries to connect between 25 s and 45 s of failures", late.Load())
	assert.GreaterOrEqual(t, late.Load(), int32(3), "tries to connect between 25 s and 45 s of failures")
}
