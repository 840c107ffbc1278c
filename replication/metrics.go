package replication

import "github.com/prometheus/client_golang/prometheus"

// metricsCollector exports what the node's pushes moved and what its sender measured of the
// link to each peer, with the decision --peer-compress auto took from it, so an operator can
// see why chunks went (or did not go) compressed.
type metricsCollector struct {
	n                                             *Node
	sent, wire, coded, corrupt, refused           *prometheus.Desc
	linkRate, linkCompressing, linkChanges, links *prometheus.Desc
}

// Collector returns a Prometheus collector of the node's peer traffic (mtcfs_peer_*).
func (n *Node) Collector() prometheus.Collector {
	peer := []string{"peer"}
	return &metricsCollector{
		n:     n,
		sent:  prometheus.NewDesc("mtcfs_peer_sent_bytes_total", "Checkpoint bytes pushed to peers, as read from the spool.", nil, nil),
		wire:  prometheus.NewDesc("mtcfs_peer_wire_bytes_total", "The same chunks' bytes on the wire (smaller when --peer-compress compressed them).", nil, nil),
		coded: prometheus.NewDesc("mtcfs_peer_chunks_compressed_total", "Chunks pushed to peers compressed.", nil, nil),
		corrupt: prometheus.NewDesc("mtcfs_peer_chunks_corrupt_total",
			"Chunks received from peers (pushed here, or fetched for a restore) that failed their CRC32C: dropped and sent again.", nil, nil),
		refused: prometheus.NewDesc("mtcfs_peer_calls_refused_total",
			"Calls to the peer port refused before their message was read: wrong or missing credentials, or a job this agent has not joined.", nil, nil),
		linkRate: prometheus.NewDesc("mtcfs_peer_link_rate_bytes",
			"Measured throughput of the link to a peer, in wire bytes/s (transfers of at least 4 MiB).", peer, nil),
		linkCompressing: prometheus.NewDesc("mtcfs_peer_link_compressing",
			"1 when chunks to this peer go compressed (--peer-compress on, or auto found the link slower than the codec).", peer, nil),
		linkChanges: prometheus.NewDesc("mtcfs_peer_link_compress_changes_total",
			"Times --peer-compress auto changed its decision for this peer.", peer, nil),
		links: prometheus.NewDesc("mtcfs_peer_link_samples_total", "Transfers to or from this peer that were measured.", peer, nil),
	}
}

func (c *metricsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.sent, c.wire, c.coded, c.corrupt, c.refused, c.linkRate, c.linkCompressing, c.linkChanges, c.links} {
		ch <- d
	}
}

func (c *metricsCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.n.PeerStats()
	ch <- prometheus.MustNewConstMetric(c.sent, prometheus.CounterValue, float64(st.BytesSent))
	ch <- prometheus.MustNewConstMetric(c.corrupt, prometheus.CounterValue, float64(st.ChunksCorrupt))
	ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(st.CallsRefused))
	ch <- prometheus.MustNewConstMetric(c.wire, prometheus.CounterValue, float64(st.WireBytesSent))
	ch <- prometheus.MustNewConstMetric(c.coded, prometheus.CounterValue, float64(st.ChunksCompressed))
	for _, l := range st.Links {
		on := 0.0
		if l.Compressing {
			on = 1
		}
		ch <- prometheus.MustNewConstMetric(c.linkRate, prometheus.GaugeValue, l.Rate, l.Peer)
		ch <- prometheus.MustNewConstMetric(c.linkCompressing, prometheus.GaugeValue, on, l.Peer)
		ch <- prometheus.MustNewConstMetric(c.linkChanges, prometheus.CounterValue, float64(l.Changes), l.Peer)
		ch <- prometheus.MustNewConstMetric(c.links, prometheus.CounterValue, float64(l.Samples), l.Peer)
	}
}
