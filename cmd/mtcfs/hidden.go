package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// hiddenYAMLMaxAge is how old a hidden replicator.yaml may be and still be answered: one left
// from a job long gone (its handshake would free the checkpoints of the job the spool holds) is
// only reported.
var hiddenYAMLMaxAge = 10 * time.Minute

// hiddenYAMLWait is how long answerHidden waits for a hidden replicator.yaml that does not parse
// to become whole (the job may still be writing it through a descriptor opened before the mount).
var hiddenYAMLWait = time.Second

// answerHidden looks at what the job wrote into the mount directory while no agent was mounted
// on it — between the detach of a dead agent's mount and this agent's mount, or before the first
// agent started — which the mount now hides from the job and from the agent alike. under is that
// directory, opened before the mount. A replicator.yaml found there is taken into the namespace
// and answered as if the job had written it through the mount (a job that wrote it there waits
// for its .restore). Other entries are reported.
//
// The yaml taken in is removed from under the mount only by the returned remove (nil when there
// is nothing to remove), which the caller calls once the agent runs: no later agent answers it
// again then, and an agent whose start fails after the take leaves it for the next one (the
// namespace that took it in goes with the failed agent, and the job still waits).
func answerHidden(under *os.File, ns tiers.Namespace, events hiddenEvents) (remove func()) {
	names, err := under.Readdirnames(-1)
	if err != nil {
		slog.Warn("cannot list the mount directory under the mount", "err", err)
		return nil
	}
	var others []string
	yaml := false
	for _, name := range names {
		if name == layout.ReplicatorYAMLName {
			yaml = true
		} else if name != "lost+found" { // a file system's own, when the mount directory is its root
			others = append(others, name)
		}
	}
	if count := len(others); count > 0 {
		shown := others
		if count > 10 {
			shown = append(others[:10:10], "…")
		}
		slog.Warn("the mount hides entries of the mount directory (written while no agent was mounted on it)", "count", count, "names", shown)
		// Told to the job too, before a hidden yaml is answered: checkpoints of a run without
		// mtcfs in the directory were hidden and the job started from scratch, told nothing
		// (found by a black-box run).
		entries := fmt.Sprintf("%d entries", count)
		if count == 1 {
			entries = "1 entry"
		}
		events.TellAtHandshake(fmt.Sprintf("the mount directory held %s before the agent mounted on it (%s): the mount hides them from the job, and they are not restored (they are not checkpoints the agent saved); they stay under the mount: copy them out once the agent stops",
			entries, strings.Join(shown, ", ")))
	}
	if yaml {
		remove = takeHiddenYAML(under, ns, events)
	}
	return remove
}

// hiddenEvents is what answerHidden tells the replicator.
type hiddenEvents interface {
	Closed(path string)
	TellAtHandshake(line string)
}

// takeHiddenYAML is answerHidden for the replicator.yaml under the mount; remove (nil: nothing to
// remove) removes the file read from under the mount.
func takeHiddenYAML(under *os.File, ns tiers.Namespace, events interface{ Closed(path string) }) (remove func()) {
	data, st, err := readHiddenYAML(under)
	if err != nil {
		slog.Warn("cannot read the replicator.yaml written under the mount", "err", err)
		return nil
	}
	if modified := time.Unix(st.Mtim.Unix()); time.Since(modified) > hiddenYAMLMaxAge {
		slog.Warn("the mount hides a replicator.yaml too old to answer; remove it from the mount directory while no agent is mounted on it",
			"modified", modified.UTC().Format(time.RFC3339), "max_age", hiddenYAMLMaxAge.String())
		return nil
	}
	if _, err := ns.ReadFile(layout.ReplicatorYAMLName, tiers.MaxConfigSize); err == nil {
		slog.Warn("removing a replicator.yaml written into the mount directory while no agent was mounted on it: the job has written one through the mount since")
	} else if err := ns.WriteFile(layout.ReplicatorYAMLName, data); err != nil {
		slog.Error("cannot take in the replicator.yaml written under the mount", "err", err)
		return nil
	} else {
		// Its owner is the job's user, whom a restored step is given to (tiers, Reown).
		if _, err := ns.Reown(layout.ReplicatorYAMLName, nil, st.Uid); err != nil {
			slog.Warn("cannot give the replicator.yaml taken in its writer's owner", "err", err)
		}
		slog.Warn("answering a replicator.yaml written into the mount directory while no agent was mounted on it (the mount hid it from the job)", "bytes", len(data))
		events.Closed(layout.ReplicatorYAMLName)
	}
	return func() {
		// Only the file read: a job still writing through a descriptor of the directory opened
		// before the mount may have replaced it since (its yaml is then left, and reported).
		var now unix.Stat_t
		if err := unix.Fstatat(int(under.Fd()), layout.ReplicatorYAMLName, &now, unix.AT_SYMLINK_NOFOLLOW); err != nil || now.Dev != st.Dev || now.Ino != st.Ino {
			slog.Warn("the replicator.yaml under the mount was replaced after it was read; left there", "err", err)
		} else if err := unix.Unlinkat(int(under.Fd()), layout.ReplicatorYAMLName, 0); err != nil {
			slog.Warn("cannot remove the replicator.yaml under the mount", "err", err)
		}
	}
}

// readHiddenYAML reads replicator.yaml from under (at most MaxConfigSize+1 bytes: the handshake
// reports a larger one), waiting up to hiddenYAMLWait while what it reads changes and does not
// parse yet; st is the file's as read last.
func readHiddenYAML(under *os.File) (data []byte, st unix.Stat_t, err error) {
	read := func() ([]byte, error) {
		fd, err := unix.Openat(int(under.Fd()), layout.ReplicatorYAMLName, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, &os.PathError{Op: "open", Path: layout.ReplicatorYAMLName, Err: err}
		}
		f := os.NewFile(uintptr(fd), layout.ReplicatorYAMLName)
		defer f.Close()
		if err := unix.Fstat(fd, &st); err != nil {
			return nil, err
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG {
			return nil, errors.New("replicator.yaml is not a regular file")
		}
		return io.ReadAll(io.LimitReader(f, tiers.MaxConfigSize+1))
	}
	data, err = read()
	for deadline := time.Now().Add(hiddenYAMLWait); err == nil && time.Now().Before(deadline); {
		if _, _, perr := tiers.ParseConfig(data, os.Getenv); perr == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
		var again []byte
		if again, err = read(); err == nil && bytes.Equal(again, data) && len(data) > 0 {
			break // unchanged: as the job wrote it (the handshake reports what is wrong)
		}
		data = again
	}
	return data, st, err
}
