package replication

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseStaticPeers(t *testing.T) {
	got, err := ParseStaticPeers(" 0=127.0.0.1:8470, 2=[::1]:9000,1=node-1.example:8470")
	require.NoError(t, err)
	require.Equal(t, StaticPeers{0: "127.0.0.1:8470", 1: "node-1.example:8470", 2: "[::1]:9000"}, got)
	p, err := got.Find(t.Context(), "job", 2)
	require.NoError(t, err)
	require.Equal(t, Peer{Addr: "[::1]:9000"}, p, "a static peer has no instance id to check")
	_, err = got.Find(t.Context(), "job", 3)
	require.ErrorContains(t, err, "rank 3 of job job is not in --peers")
}
