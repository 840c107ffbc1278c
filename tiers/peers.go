package tiers

// PeerRanks chooses the ranks that node rank replicates to when the job gave
// peers-per-node instead of explicit peer-ranks (SPEC §4). It follows the
// reference replicator so that a job moving between the two sees the same
// topology:
//
//   - Data-parallel mode (dataParallelism D > 0, partition P = nodes / D):
//     the column-mates (r + a·P) mod nodes for a = -1, +1, -2, +2, …, so the
//     nearest replicas of the same data come first. Only the D-1 other
//     members of r's column exist, so at most D-1 peers are returned: D = 2
//     yields one peer whatever peersPerNode is, D = 1 none.
//   - Otherwise: first the neighbour r XOR 1 (mod nodes) — likely in the same
//     rack, cheap to reach — then (r + (nodes / K)·i) mod nodes for
//     i = 1..K-1, spread evenly around the ring so that one failure domain
//     does not hold every copy.
//
// Duplicates and r itself are dropped ("collapse"), so the result has at most
// peersPerNode ranks, possibly fewer (nodes = 4, K = 3 gives two peers, as in
// the reference). The order is the order above; it is the preference order
// for replication. A job of one node, peersPerNode ≤ 0, or a rank outside
// [0, nodes) has no peers: the result is nil.
func PeerRanks(rank, nodes, peersPerNode, dataParallelism int) []int {
	if nodes <= 1 || peersPerNode <= 0 || rank < 0 || rank >= nodes {
		return nil
	}
	var peers []int
	seen := map[int]bool{rank: true} // self is "seen" so it is never a peer
	add := func(p int) {
		p %= nodes
		if p < 0 {
			p += nodes // Go's % keeps the dividend's sign
		}
		if !seen[p] && len(peers) < peersPerNode {
			seen[p] = true
			peers = append(peers, p)
		}
	}

	if dataParallelism > 0 {
		partition := nodes / dataParallelism
		if partition == 0 {
			return nil // more replicas than nodes: no valid column layout
		}
		// a = ±1 … ±D reaches every member of the column (a = ±D is r
		// itself); further a only repeat, so the loop is bounded by 2·D
		// rather than by how many peers were asked for.
		for i := 0; i < 2*dataParallelism && len(peers) < peersPerNode; i++ {
			a := i/2 + 1
			if i%2 == 0 {
				a = -a
			}
			add(rank + a*partition)
		}
		return peers
	}

	add(rank ^ 1)
	dist := nodes / peersPerNode
	// dist·i mod nodes repeats after at most nodes steps, so i ≤ nodes bounds
	// the loop even when far more peers are asked for than exist.
	for i := 1; i < peersPerNode && i <= nodes && len(peers) < peersPerNode; i++ {
		add(rank + dist*i)
	}
	return peers
}
