package tiers

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
)

// adopt takes over the committed data a previous agent on this mount left in the spool (SPEC
// §7): every .meta whose data verifies against its hash is published again, so a job that
// restarts on this node restores from RAM. Everything else left behind is removed. It runs at
// Start, before any other stage: nothing competes with it. Problems the job must hear of go to
// report, for the next handshake.
func (rt *retention) adopt(ctx context.Context, report func(string)) error {
	for _, d := range []string{"staging", "incoming"} {
		if err := os.RemoveAll(rt.spoolDir(d)); err != nil {
			return err
		}
	}
	for _, d := range []string{"sealed", "meta", "staging", "incoming"} {
		if err := os.MkdirAll(rt.spoolDir(d), 0o700); err != nil {
			return err
		}
	}
	ents, err := os.ReadDir(rt.spoolDir("meta"))
	if err != nil {
		return err
	}
	verified := map[string]bool{}
	// In data-parallel mode a node holds its column-mates' .meta files without their data
	// (SPEC §4: only .meta files are exchanged): such a .meta is kept as it was, not dropped
	// with an error line to the job at every restart (found by a black-box run).
	dataParallel := rt.spool != nil && rt.spool.SavedShape().DataParallelism > 0
	for _, e := range ents {
		name := e.Name()
		m, ok := layout.ParseMarkerName(name)
		if !ok || m.Kind != layout.MarkerMeta {
			os.Remove(rt.spoolDir("meta", name))
			continue
		}
		content, err := os.ReadFile(rt.spoolDir("meta", name))
		hash := strings.TrimSpace(string(content))
		dataName := hash + ".data"
		if _, statErr := os.Lstat(rt.spoolDir("sealed", dataName)); err == nil && dataParallel && errors.Is(statErr, fs.ErrNotExist) && layout.IsDataName(dataName) {
			if err := rt.writeFile(name, []byte(hash)); err != nil {
				return err
			}
			rt.mu.Lock()
			rt.metas[name] = hash
			rt.mu.Unlock()
			rt.log.Info("adopted a column-mate's .meta from spool", "meta", name, "data", dataName)
			continue
		}
		if err == nil && !verified[dataName] {
			h, dir, ok := layout.ParseDataName(dataName)
			if !ok {
				err = fmt.Errorf("bad hash %q", hash)
			} else {
				// The namespace builds the tree while its data is verified (both take a
				// system call or more per file); the name appears only once it verified.
				p := rt.spoolDir("sealed", dataName)
				passed := false
				verify := func(listing []layout.TreeEntry) error {
					err := layout.VerifyListed(ctx, p, listing, h, dir) // the listing the tree is built from
					passed = err == nil
					return err
				}
				err = rt.ns.ImportVerified(p, dataName, verify)
				if errors.Is(err, ErrNameTaken) { // a name already there is kept if the data verifies
					err = nil
					if !passed {
						err = verify(nil)
					}
				}
			}
			if err == nil {
				rt.markVerified(dataName)
			}
			verified[dataName] = err == nil
		}
		if err != nil || !verified[dataName] {
			rt.log.Warn("dropping spool data that does not verify", "meta", name, "err", err)
			rt.metrics.error(errKindVerify)
			if err != nil {
				report(fmt.Sprintf("%s in this node's RAM was dropped when the agent restarted: %v (it is restored from a peer or a backup if one holds it)", name, err))
			}
			os.Remove(rt.spoolDir("meta", name))
			continue
		}
		// In the headroom if need be: a spool whose step filled the budget to the last page
		// had no room for it, and the agent failed at every start (found by a black-box run).
		if err := rt.writeFile(name, []byte(hash)); err != nil {
			return err
		}
		rt.mu.Lock()
		rt.metas[name] = hash
		rt.mu.Unlock()
		rt.log.Info("adopted from spool", "meta", name, "data", dataName)
	}
	sealed, _ := os.ReadDir(rt.spoolDir("sealed"))
	for _, e := range sealed {
		if !verified[e.Name()] && !verified[strings.TrimSuffix(e.Name(), ".attrs")] { // attrs stay with their data
			os.RemoveAll(rt.spoolDir("sealed", e.Name()))
		}
	}
	return nil
}
