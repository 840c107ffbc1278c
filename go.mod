module github.com/mtcfs/mtcfs

go 1.26.8

require (
	github.com/hanwen/go-fuse/v2 v2.12.1
	github.com/stretchr/testify v1.12.1
	github.com/zeebo/blake3 v0.2.4
	golang.org/x/sys v0.50.0
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
	gopkg.in/yaml.v3 v3.0.1
	lukechampine.com/blake3 v1.4.1
)

require (
	github.com/klauspost/cpuid/v2 v2.0.12 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
)
