package main

import (
	"context"
	"encoding/hex"

	"google.golang.org/grpc"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
	"github.com/mtcfs/mtcfs/tiers"
)

// The early side of the peer transport (tiers.EarlyTransport): files pushed while their step is
// still being written, and the sealed push that reuses them.

var _ tiers.EarlyTransport = (*peerService)(nil)

func (p *peerService) PushEarly(ctx context.Context, inc tiers.Incarnation, rank int, group, path string) (layout.FileDigest, error) {
	hash, _, err := layout.HashDataCached(ctx, path, p.sender.Digests)
	if err != nil {
		return layout.FileDigest{}, err
	}
	var d layout.FileDigest
	if _, err := hex.Decode(d[:], []byte(hash)); err != nil {
		return d, err
	}
	return d, p.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, conn *grpc.ClientConn) error {
		return p.sender.Push(ctx, conn, replication.PushRequest{Job: inc.Config.JobName, Incarnation: inc.ID,
			Rank: inc.Config.NodeRank, DataName: layout.DataName(hash, false), Source: path, EarlyGroup: group})
	})
}

func (p *peerService) PushConsuming(ctx context.Context, inc tiers.Incarnation, rank int, name, path, group string, acked map[layout.FileDigest]bool) error {
	return p.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, conn *grpc.ClientConn) error {
		return p.sender.Push(ctx, conn, replication.PushRequest{Job: inc.Config.JobName, Incarnation: inc.ID,
			Rank: inc.Config.NodeRank, DataName: name, Source: path, ConsumesGroup: group, Presumed: acked})
	})
}

func (p *peerService) DropEarly(ctx context.Context, inc tiers.Incarnation, rank int, group string) error {
	return p.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, conn *grpc.ClientConn) error {
		return p.sender.Drop(ctx, conn, replication.Identity{Job: inc.Config.JobName, Incarnation: inc.ID,
			Rank: inc.Config.NodeRank, Instance: p.coord.instance}, group)
	})
}
