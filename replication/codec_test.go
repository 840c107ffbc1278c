package replication

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// split cuts b into buffers of at most n bytes, as gRPC hands over HTTP/2 frames.
func split(b []byte, n int) mem.BufferSlice {
	var out mem.BufferSlice
	for len(b) > 0 {
		k := min(n, len(b))
		out = append(out, mem.SliceBuffer(b[:k]))
		b = b[k:]
	}
	return out
}

// TestCodecMatchesProto checks that peerCodec speaks peer.proto's wire format both ways.
func TestCodecMatchesProto(t *testing.T) {
	data := bytes.Repeat([]byte("0123456789"), 1000)
	for _, c := range []outChunk{{file: 3, offset: 1 << 40, crc: 0xdeadbeef}, {file: 0, offset: 0, crc: 0}} {
		buf := chunkBuffers.Get(len(data))
		copy(*buf, data)
		c.buf = buf
		wire := c.encode().Materialize()

		var pm peerpb.PushMessage
		require.NoError(t, proto.Unmarshal(wire, &pm))
		got := pm.GetChunk()
		require.NotNil(t, got)
		require.Equal(t, c.file, got.File)
		require.Equal(t, c.offset, got.Offset)
		require.Equal(t, c.crc, got.Crc32C)
		require.Equal(t, data, got.Data)

		// And back, from frames of every size, including ones that cut fields apart.
		for _, frame := range []int{1, 7, 1000, len(wire)} {
			m := inMessage{header: &peerpb.PushHeader{}}
			require.NoError(t, m.decode(split(wire, frame)))
			require.False(t, m.isHeader)
			require.Equal(t, c.file, m.chunk.file)
			require.Equal(t, c.offset, m.chunk.offset)
			require.Equal(t, c.crc, m.chunk.crc)
			require.Equal(t, data, m.chunk.data.Materialize(), "frame size %d", frame)
			m.chunk.release()
		}
	}

	// A header, and a chunk with an unknown field, encoded by protobuf itself.
	h := &peerpb.PushHeader{TransferId: "t", Job: "j", Manifest: &peerpb.Manifest{DataName: "x"}}
	wire, err := proto.Marshal(&peerpb.PushMessage{Kind: &peerpb.PushMessage_Header{Header: h}})
	require.NoError(t, err)
	m := inMessage{header: &peerpb.PushHeader{}}
	require.NoError(t, m.decode(split(wire, 3)))
	require.True(t, m.isHeader)
	require.True(t, proto.Equal(h, m.header))

	chunk := &peerpb.Chunk{File: 1, Offset: 5, Data: []byte("abc"), Crc32C: 7}
	chunk.ProtoReflect().SetUnknown([]byte{0x50, 0x01}) // field 10, varint 1
	wire, err = proto.Marshal(&peerpb.PushMessage{Kind: &peerpb.PushMessage_Chunk{Chunk: chunk}})
	require.NoError(t, err)
	require.NoError(t, m.decode(split(wire, 2)))
	require.False(t, m.isHeader)
	require.Equal(t, []byte("abc"), m.chunk.data.Materialize())
	m.chunk.release()

	for _, bad := range [][]byte{{0x12, 0x05, 0x1a}, {0x12}, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, {}} {
		require.Error(t, m.decode(split(bad, 1)), "%x", bad)
	}
}
