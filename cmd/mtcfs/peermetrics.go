package main

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/mtcfs/mtcfs/replication"
)

// peerLinkCollector exports what the sender measured of the link to each peer, and the
// decision --peer-compress auto took from it, so an operator can see why chunks went (or did
// not go) compressed.
type peerLinkCollector struct {
	links                            func() []replication.PeerLink
	rate, compressing, changes, runs *prometheus.Desc
}

func newPeerLinkCollector(links func() []replication.PeerLink) *peerLinkCollector {
	peer := []string{"peer"}
	return &peerLinkCollector{
		links: links,
		rate: prometheus.NewDesc("mtcfs_peer_link_rate_bytes", "Measured throughput of the link to a peer, in wire bytes/s (transfers of at least 4 MiB).",
			peer, nil),
		compressing: prometheus.NewDesc("mtcfs_peer_link_compressing", "1 when chunks to this peer go compressed (--peer-compress on, or auto found the link slower than the codec).",
			peer, nil),
		changes: prometheus.NewDesc("mtcfs_peer_link_compress_changes_total", "Times --peer-compress auto changed its decision for this peer.",
			peer, nil),
		runs: prometheus.NewDesc("mtcfs_peer_link_samples_total", "Transfers to or from this peer that were measured.",
			peer, nil),
	}
}

func (c *peerLinkCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.rate
	ch <- c.compressing
	ch <- c.changes
	ch <- c.runs
}

func (c *peerLinkCollector) Collect(ch chan<- prometheus.Metric) {
	for _, l := range c.links() {
		on := 0.0
		if l.Compressing {
			on = 1
		}
		ch <- prometheus.MustNewConstMetric(c.rate, prometheus.GaugeValue, l.Rate, l.Peer)
		ch <- prometheus.MustNewConstMetric(c.compressing, prometheus.GaugeValue, on, l.Peer)
		ch <- prometheus.MustNewConstMetric(c.changes, prometheus.CounterValue, float64(l.Changes), l.Peer)
		ch <- prometheus.MustNewConstMetric(c.runs, prometheus.CounterValue, float64(l.Samples), l.Peer)
	}
}
