package tiers

import (
	"slices"
	"testing"
)

// The expected peers below are worked out by hand from SPEC §4; the comment
// of each case shows the arithmetic.
func TestPeerRanks(t *testing.T) {
	tests := []struct {
		name                    string
		rank, nodes, k, dataPar int
		want                    []int
	}{
		// Non-data-parallel: r XOR 1, then r + (nodes/K)·i for i = 1..K-1.
		{"8 nodes K=2 rank 0", 0, 8, 2, 0, []int{1, 4}},    // 0^1=1; 0+4=4
		{"8 nodes K=2 rank 5", 5, 8, 2, 0, []int{4, 1}},    // 5^1=4; 5+4=9≡1
		{"8 nodes K=2 rank 7", 7, 8, 2, 0, []int{6, 3}},    // 7^1=6; 7+4=11≡3
		{"8 nodes K=3 rank 0", 0, 8, 3, 0, []int{1, 2, 4}}, // 0^1=1; dist 8/3=2: 2, 4
		{"8 nodes K=3 rank 3", 3, 8, 3, 0, []int{2, 5, 7}}, // 3^1=2; 3+2=5, 3+4=7
		{"8 nodes K=1 rank 6", 6, 8, 1, 0, []int{7}},       // 6^1=7 only
		{"5 nodes K=2 rank 4", 4, 5, 2, 0, []int{0, 1}},    // 4^1=5≡0; dist 2: 4+2=6≡1
		{"5 nodes K=2 rank 0", 0, 5, 2, 0, []int{1, 2}},    // 0^1=1; 0+2=2
		{"2 nodes K=1 rank 0", 0, 2, 1, 0, []int{1}},
		{"2 nodes K=1 rank 1", 1, 2, 1, 0, []int{0}},
		{"3 nodes K=2 rank 0", 0, 3, 2, 0, []int{1}},     // 0^1=1; dist 1: 0+1=1 collapses
		{"3 nodes K=2 rank 2", 2, 3, 2, 0, []int{0}},     // 2^1=3≡0; 2+1=3≡0 collapses
		{"4 nodes K=3 rank 0", 0, 4, 3, 0, []int{1, 2}},  // 0^1=1; dist 1: 1 (dup), 2
		{"4 nodes K=2 rank 1", 1, 4, 2, 0, []int{0, 3}},  // 1^1=0; 1+2=3
		{"more peers than nodes", 0, 3, 10, 0, []int{1}}, // 0^1=1; dist 3/10=0 gives only 0, self
		{"one node", 0, 1, 1, 0, nil},
		{"one node, several asked", 0, 1, 4, 0, nil},
		{"no peers asked", 3, 8, 0, 0, nil},
		{"rank out of range", 8, 8, 2, 0, nil},
		{"negative rank", -1, 8, 2, 0, nil},

		// Data-parallel: (r + a·P) mod nodes for a = -1, +1, -2, +2, …
		{"D=4 P=2 K=2 rank 0", 0, 8, 2, 4, []int{6, 2}},          // -2≡6, +2
		{"D=4 P=2 K=2 rank 3", 3, 8, 2, 4, []int{1, 5}},          // 3-2=1, 3+2=5
		{"D=4 P=2 K=3 rank 0", 0, 8, 3, 4, []int{6, 2, 4}},       // then -4≡4
		{"D=4 P=2 K=5 rank 0", 0, 8, 5, 4, []int{6, 2, 4}},       // only D-1=3 column-mates exist
		{"D=2 P=4 K=2 rank 1", 1, 8, 2, 2, []int{5}},             // 1-4≡5, 1+4=5: one mate
		{"D=2 P=4 K=3 rank 6", 6, 8, 3, 2, []int{2}},             // 6-4=2, 6+4≡2, 6±8≡6 is self
		{"D=1 no column-mates", 2, 4, 1, 1, nil},                 // 2±4≡2 is self
		{"D=nodes all are mates", 1, 4, 3, 4, []int{0, 2, 3}},    // P=1: 0, 2, then -2≡3
		{"D=3 P=2 rank 5", 5, 6, 2, 3, []int{3, 1}},              // 5-2=3, 5+2=7≡1
		{"D=3 P=2 rank 5 K=1", 5, 6, 1, 3, []int{3}},             // nearest first
		{"D=8 P=4 K=4 rank 9", 9, 32, 4, 8, []int{5, 13, 1, 17}}, // 9-4, 9+4, 9-8, 9+8
		{"D larger than nodes", 0, 4, 2, 8, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := PeerRanks(tt.rank, tt.nodes, tt.k, tt.dataPar)
			if !slices.Equal(got, tt.want) {
				t.Errorf("PeerRanks(rank %d, nodes %d, K %d, D %d) = %v, want %v", tt.rank, tt.nodes, tt.k, tt.dataPar, got, tt.want)
			}
		})
	}
}

// TestPeerRanksProperties checks every rank of every job size up to 64 nodes,
// every K and every D that divides the job.
func TestPeerRanksProperties(t *testing.T) {
	for nodes := 1; nodes <= 64; nodes++ {
		for k := 0; k <= nodes+1; k++ {
			for d := 0; d <= nodes; d++ {
				if d > 0 && nodes%d != 0 {
					continue
				}
				for rank := 0; rank < nodes; rank++ {
					checkPeers(t, rank, nodes, k, d, PeerRanks(rank, nodes, k, d))
				}
			}
		}
	}
}

func checkPeers(t *testing.T, rank, nodes, k, d int, peers []int) {
	t.Helper()
	fail := func(why string) {
		t.Helper()
		t.Fatalf("PeerRanks(rank %d, nodes %d, K %d, D %d) = %v: %s", rank, nodes, k, d, peers, why)
	}
	if len(peers) > k {
		fail("more peers than asked for")
	}
	if len(peers) > nodes-1 {
		fail("more peers than other nodes")
	}
	seen := map[int]bool{}
	for _, p := range peers {
		switch {
		case p < 0 || p >= nodes:
			fail("a rank out of range")
		case p == rank:
			fail("the node itself is a peer")
		case seen[p]:
			fail("a duplicate peer")
		}
		seen[p] = true
	}
	if d > 0 {
		partition := nodes / d
		for _, p := range peers {
			if p%partition != rank%partition {
				fail("a peer outside the node's column")
			}
		}
		// Every column-mate is reachable, so exactly min(K, D-1) come back.
		if want := min(k, d-1); len(peers) != want {
			fail("not min(K, D-1) column-mates")
		}
	} else if k >= 1 && nodes > 1 && (rank^1)%nodes != rank && (len(peers) == 0 || peers[0] != (rank^1)%nodes) {
		fail("the first peer is not rank XOR 1")
	}
}

func TestConfigPeers(t *testing.T) {
	tests := []struct {
		name string
		c    Config
		want []int
	}{
		{"explicit ranks win", Config{NodeRank: 0, Nodes: 8, PeerRanks: []int{5, 3}, PeersPerNode: 2}, []int{5, 3}},
		{"explicit none", Config{NodeRank: 0, Nodes: 8, PeerRanks: []int{}, PeersPerNode: 2}, nil},
		{"chosen", Config{NodeRank: 5, Nodes: 8, PeersPerNode: 2}, []int{4, 1}},
		{"chosen data-parallel", Config{NodeRank: 0, Nodes: 8, PeersPerNode: 2, AssumeDataParallelism: 4}, []int{6, 2}},
		{"one node", Config{NodeRank: 0, Nodes: 1, PeersPerNode: 1}, nil},
	}
	for _, tt := range tests {
		if got := tt.c.Peers(); !slices.Equal(got, tt.want) {
			t.Errorf("%s: Peers() = %v, want %v", tt.name, got, tt.want)
		}
	}
}
