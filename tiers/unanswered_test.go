package tiers

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/stretchr/testify/require"
)

// A .save committed while the agent answers no job is reported at its flush and again at its
// close; it is one commit, and the log's count says so (it counted two).
func TestUnansweredSaveCountedOnce(t *testing.T) {
	var log bytes.Buffer
	n := &node{log: slog.New(slog.NewTextHandler(&log, nil)), yield: newYielder(nil)}
	cr := newCommitRecorder(n, &incarnations{}, nil, nil)
	save := layout.MarkerName{Job: "j", Step: 3, Kind: layout.MarkerSave}.String()
	other := layout.MarkerName{Job: "j", Step: 3, Worker: 1, Kind: layout.MarkerSave}.String()
	cr.record(event{kind: evClosed, path: save})  // its flush
	cr.record(event{kind: evClosed, path: other}) // another worker's flush
	cr.record(event{kind: evClosed, path: save})  // the first one's close
	cr.record(event{kind: evClosed, path: other})
	cr.record(event{kind: evRenamed, path: "4", typ: layout.EntryDir})
	cr.record(event{kind: evClosed, path: "4/data"}) // inside a step: no commit
	require.Equal(t, 3, cr.unanswered)
	require.Equal(t, 1, strings.Count(log.String(), "answers no job"), "logged once, at the first")
	require.Contains(t, log.String(), "step=3")
}
