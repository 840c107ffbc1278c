package replication

import (
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// codedError is an error with the gRPC status code it must travel as. gRPC finds the code through
// GRPCStatus even when the error is wrapped, so handlers return errors with context added by
// fmt.Errorf and the code survives; this is the one place that decides codes. Callers read the code with status.Code.
type codedError struct {
	code codes.Code
	err  error
}

func (e *codedError) Error() string { return e.err.Error() }
func (e *codedError) Unwrap() error { return e.err }

// GRPCStatus lets gRPC send the error with its code.
func (e *codedError) GRPCStatus() *status.Status { return status.New(e.code, e.err.Error()) }

func withCode(code codes.Code, format string, args ...any) error {
	return &codedError{code: code, err: fmt.Errorf(format, args...)}
}

// The kinds of refusal a peer can get, one constructor each so that a call site reads as what
// went wrong.
func errInvalid(format string, args ...any) error {
	return withCode(codes.InvalidArgument, format, args...)
}
func errUnauthenticated(format string, args ...any) error {
	return withCode(codes.Unauthenticated, format, args...)
}
func errPermission(format string, args ...any) error {
	return withCode(codes.PermissionDenied, format, args...)
}
func errExhausted(format string, args ...any) error {
	return withCode(codes.ResourceExhausted, format, args...)
}
func errCorrupt(format string, args ...any) error { return withCode(codes.DataLoss, format, args...) }
func errPrecondition(format string, args ...any) error {
	return withCode(codes.FailedPrecondition, format, args...)
}
func errAborted(format string, args ...any) error  { return withCode(codes.Aborted, format, args...) }
func errNotFound(format string, args ...any) error { return withCode(codes.NotFound, format, args...) }
