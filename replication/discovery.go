package replication

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// Discovery tells an agent where the other agents of a job listen. Registry finds them through
// the backup location (nothing but a shared --backup to configure); StaticPeers is a fixed list
// (mtcfs mount --peers).
type Discovery interface {
	// Find returns where rank's agent of job listens.
	Find(ctx context.Context, job string, rank int) (Peer, error)
}

// Peer is where one agent listens. Instance, when known (not ""), is the agent process's id:
// calls carry it, so that another agent now at that address refuses them (WithTarget).
type Peer struct{ Addr, Instance string }

// StaticPeers maps ranks to addresses, the same for every job.
type StaticPeers map[int]string

var _ Discovery = StaticPeers(nil)

func (s StaticPeers) Find(_ context.Context, job string, rank int) (Peer, error) {
	addr, ok := s[rank]
	if !ok {
		return Peer{}, fmt.Errorf("rank %d of job %s is not in --peers", rank, job)
	}
	return Peer{Addr: addr}, nil
}

// ParseStaticPeers parses RANK=HOST:PORT entries separated by commas (mtcfs mount --peers).
func ParseStaticPeers(s string) (StaticPeers, error) {
	peers := StaticPeers{}
	for _, ent := range strings.Split(s, ",") {
		ent = strings.TrimSpace(ent)
		if ent == "" {
			return nil, fmt.Errorf("empty entry in %q: want RANK=HOST:PORT,RANK=HOST:PORT,...", s)
		}
		rankStr, addr, ok := strings.Cut(ent, "=")
		if !ok {
			return nil, fmt.Errorf("entry %q: want RANK=HOST:PORT", ent)
		}
		rank, err := strconv.Atoi(strings.TrimSpace(rankStr))
		if err != nil || rank < 0 {
			return nil, fmt.Errorf("entry %q: rank %q is not a number ≥ 0", ent, rankStr)
		}
		if _, dup := peers[rank]; dup {
			return nil, fmt.Errorf("rank %d is given twice", rank)
		}
		addr = strings.TrimSpace(addr)
		if err := CheckAddr(addr); err != nil {
			return nil, fmt.Errorf("entry %q: address %q: %w", ent, addr, err)
		}
		peers[rank] = addr
	}
	return peers, nil
}

// CheckAddr accepts HOST:PORT with a non-empty host and a port 1–65535: an address another
// agent can dial.
func CheckAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return errors.New("want HOST:PORT")
	}
	if host == "" {
		return errors.New("want HOST:PORT with a host other agents can reach")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("port %q: want a number from 1 to 65535", port)
	}
	return nil
}
