package replication

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Calls name the agent they are meant for. Agents find each other through registrations that
// may be stale (a killed agent's file stays; its address may be reused by another agent), so a
// call carries the instance id of the agent whose registration it used, and an agent refuses a
// call meant for another instance with UNAVAILABLE — the caller looks the address up again and
// retries — instead of taking data or coordinating for a rank it is not.

// targetKey is the metadata key holding the instance id a call is meant for.
const targetKey = "mtcfs-target-instance"

// WithTarget returns ctx whose outgoing calls say they are meant for the agent instance (from
// its registration). An empty instance (a static address, no registration) adds nothing.
func WithTarget(ctx context.Context, instance string) context.Context {
	if instance == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, targetKey, instance)
}

// checkTarget refuses an incoming call meant for another instance than self ("" accepts all).
func checkTarget(ctx context.Context, self string) error {
	if self == "" {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	want := md.Get(targetKey)
	if len(want) == 0 || want[0] == self {
		return nil
	}
	return status.Errorf(codes.Unavailable, "this is agent instance %s, not %s: %s; look the address up again", self, want[0], staleRegistration)
}

// staleRegistration is the part of checkTarget's refusal its callers recognise.
const staleRegistration = "the caller used a stale registration"
