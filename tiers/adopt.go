package tiers

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
)

// adopt takes over the committed data a previous agent on this mount left in the spool (SPEC
// §7): every .meta whose data verifies against its hash is published again, so a job that
// restarts on this node restores from RAM. Everything else left behind is removed.
func (r *Replicator) adopt(ctx context.Context) error {
	for _, d := range []string{"staging", "incoming"} {
		if err := os.RemoveAll(r.spoolDir(d)); err != nil {
			return err
		}
	}
	for _, d := range []string{"sealed", "meta", "staging", "incoming"} {
		if err := os.MkdirAll(r.spoolDir(d), 0o700); err != nil {
			return err
		}
	}
	ents, err := os.ReadDir(r.spoolDir("meta"))
	if err != nil {
		return err
	}
	verified := map[string]bool{}
	for _, e := range ents {
		name := e.Name()
		m, ok := layout.ParseMarkerName(name)
		if !ok || m.Kind != layout.MarkerMeta {
			os.Remove(r.spoolDir("meta", name))
			continue
		}
		content, err := os.ReadFile(r.spoolDir("meta", name))
		hash := strings.TrimSpace(string(content))
		dataName := hash + ".data"
		if err == nil && !verified[dataName] {
			h, dir, ok := layout.ParseDataName(dataName)
			if !ok {
				err = fmt.Errorf("bad hash %q", hash)
			} else {
				err = layout.VerifyData(ctx, r.spoolDir("sealed", dataName), h, dir)
			}
			if err == nil {
				r.markVerified(dataName)
			}
			if err == nil {
				if err = r.ns.Import(r.spoolDir("sealed", dataName), dataName); errors.Is(err, os.ErrExist) {
					err = nil
				}
			}
			verified[dataName] = err == nil
		}
		if err != nil || !verified[dataName] {
			r.log.Warn("dropping spool data that does not verify", "meta", name, "err", err)
			r.metrics.error(errKindVerify)
			if err != nil {
				r.startupError(fmt.Sprintf("%s in this node's RAM was dropped when the agent restarted: %v (it is restored from a peer or a backup if one holds it)", name, err))
			}
			os.Remove(r.spoolDir("meta", name))
			continue
		}
		if err := r.ns.WriteFile(name, []byte(hash)); err != nil {
			return err
		}
		r.mu.Lock()
		r.metas[name] = hash
		r.mu.Unlock()
		r.log.Info("adopted from spool", "meta", name, "data", dataName)
	}
	sealed, _ := os.ReadDir(r.spoolDir("sealed"))
	for _, e := range sealed {
		if !verified[e.Name()] {
			os.RemoveAll(r.spoolDir("sealed", e.Name()))
		}
	}
	return nil
}
