package gcsbackend

import (
	"context"
	"errors"
	"io/fs"
)

// SmallObjects serves small objects of Store read and written whole, with errors that need no
// import of this package to be told apart: a missing object is fs.ErrNotExist, a create-if-absent
// that found other content fs.ErrExist (errors.Is). It is what the cluster (package replication:
// the agent registry and the job secrets) keeps in the backup location.
type SmallObjects struct{ Store ObjectStore }

func (o SmallObjects) String() string { return o.Store.String() }

// Get returns the object's content, failing when it is larger than limit bytes.
func (o SmallObjects) Get(ctx context.Context, name string, limit int64) ([]byte, error) {
	data, err := ReadSmall(ctx, o.Store, name, limit)
	return data, portable(err)
}

// Put stores data under name, replacing any object there.
func (o SmallObjects) Put(ctx context.Context, name string, data []byte) error {
	return portable(PutBytes(ctx, o.Store, name, data, false))
}

// PutIfAbsent stores data under name unless an object with other content is there. The same
// content counts as success, so that a retried create is safe.
func (o SmallObjects) PutIfAbsent(ctx context.Context, name string, data []byte) error {
	return portable(PutBytes(ctx, o.Store, name, data, true))
}

// List returns the names of the objects directly below prefix (none below a further "/").
func (o SmallObjects) List(ctx context.Context, prefix string) ([]string, error) {
	objects, _, err := o.Store.List(ctx, prefix, "/")
	if err != nil {
		return nil, portable(err)
	}
	names := make([]string, len(objects))
	for i, obj := range objects {
		names[i] = obj.Name
	}
	return names, nil
}

// Delete removes the object.
func (o SmallObjects) Delete(ctx context.Context, name string) error {
	return portable(o.Store.Delete(ctx, name))
}

// portable makes the store's typed errors match the io/fs sentinels as well.
func portable(err error) error {
	var pre *PreconditionError
	switch {
	case err == nil:
		return nil
	case IsNotFound(err):
		return sentinelError{err, fs.ErrNotExist}
	case errors.As(err, &pre):
		return sentinelError{err, fs.ErrExist}
	}
	return err
}

// sentinelError is err that also matches is.
type sentinelError struct {
	error
	is error
}

func (e sentinelError) Unwrap() error        { return e.error }
func (e sentinelError) Is(target error) bool { return target == e.is }
