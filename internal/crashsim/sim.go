package crashsim

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"time"
)

// Config is one run.
type Config struct {
	Bin     string // the mtcfs binary
	WorkDir string // where episodes make their mount points, spools and backup directories
	Seed    uint64
	Kills   int // at least this many kills (the plan rounds up to whole episodes)
	Scale   Scale
	// Logf receives progress: the plan, each op, each kill and recovery (nil: silent).
	Logf func(format string, args ...any)
	// Verbose passes the scripted clients' own log lines to Logf too.
	Verbose bool
	// LogDir, when set, receives the full logs of every agent of an episode that had a finding
	// (e<episode>-rank<r>-pid<pid>.log).
	LogDir string
}

// Finding is something a run found: a violation of the invariant or of another guarantee
// (Violation), or a failure that replicator.errors explained, which the invariant tolerates
// but a report must mention.
type Finding struct {
	Violation bool
	Episode   int
	Op        int
	What      string // one line
	Detail    string // the sequence that led to it, the agents' log lines that matter
}

func (f Finding) String() string {
	kind := "finding"
	if f.Violation {
		kind = "VIOLATION"
	}
	return fmt.Sprintf("%s (episode %d, op %d): %s", kind, f.Episode, f.Op, f.What)
}

// Report is what a run measured.
type Report struct {
	Seed       uint64
	Scale      string
	Episodes   []EpisodeReport
	Kills      map[Kind]int // agents killed, by the kind of moment aimed at
	Hits       map[Kind]int // of those, the kills at which the victim was seen in that state
	Evidence   map[string]int
	Drops      int            // node replacements (RAM lost)
	Recoveries int            // job restarts after kills, each checked against the invariant
	Restarts   int            // job restarts without a kill, checked too
	Saves      int            // save rounds
	Restores   map[string]int // checked job starts by where the step came from
	// ErrorLines counts the lines the job read from replicator.errors, by message (numbers,
	// hashes and addresses replaced), to show what the agents told the job.
	ErrorLines map[string]int
	Findings   []Finding
	Duration   time.Duration
	Stopped    bool // the run was cancelled before the plan's end
}

// EpisodeReport is one episode as it ran.
type EpisodeReport struct {
	Spec       Episode
	Kills      int // agents killed
	Violations int
	Completed  bool // the script ran to its end (a violation may end it early)
}

// Violations returns the findings that break the invariant or another guarantee.
func (r *Report) Violations() []Finding {
	var out []Finding
	for _, f := range r.Findings {
		if f.Violation {
			out = append(out, f)
		}
	}
	return out
}

// TotalKills sums Kills.
func (r *Report) TotalKills() int {
	n := 0
	for _, v := range r.Kills {
		n += v
	}
	return n
}

// Summary is a few lines for logs.
func (r *Report) Summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d (%s): %d episodes, %d kills, %d recoveries, %d restarts, %d drops, %d save rounds in %v\n",
		r.Seed, r.Scale, len(r.Episodes), r.TotalKills(), r.Recoveries, r.Restarts, r.Drops, r.Saves, r.Duration.Round(time.Second))
	b.WriteString("kills by kind (hit = the victim was seen in that state):")
	for _, k := range Kinds {
		if r.Kills[k] > 0 {
			fmt.Fprintf(&b, " %s %d (hit %d);", k, r.Kills[k], r.Hits[k])
		}
	}
	b.WriteString("\nevidence at the kills:")
	for _, k := range sortedKeys(r.Evidence) {
		fmt.Fprintf(&b, " %s %d;", k, r.Evidence[k])
	}
	b.WriteString("\nrestores:")
	for _, k := range sortedKeys(r.Restores) {
		fmt.Fprintf(&b, " %s %d;", k, r.Restores[k])
	}
	b.WriteString("\nreplicator.errors lines read by the job:")
	for _, k := range sortedKeys(r.ErrorLines) {
		fmt.Fprintf(&b, "\n  %d× %s", r.ErrorLines[k], k)
	}
	fmt.Fprintf(&b, "\n%d violations, %d other findings\n", len(r.Violations()), len(r.Findings)-len(r.Violations()))
	for _, f := range r.Findings {
		b.WriteString(f.String() + "\n")
	}
	return b.String()
}

var (
	errPrefixRE = regexp.MustCompile(`^\S+ job=\S+ node=\S+ (ERR|FATAL) `)
	hexRE       = regexp.MustCompile(`D?[0-9a-f]{16,}`)
	numberRE    = regexp.MustCompile(`[0-9]+`)
)

// errorKind normalises a replicator.errors line for counting.
func errorKind(line string) string {
	s := errPrefixRE.ReplaceAllString(line, "")
	s = hexRE.ReplaceAllString(s, "H")
	s = numberRE.ReplaceAllString(s, "N")
	if len(s) > 160 {
		s = s[:160] + "…"
	}
	return s
}

func sortedKeys(m map[string]int) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// Run executes the decision sequence drawn from cfg.Seed: episode after episode, each a job on
// fresh nodes that is saved, killed, recovered and checked as its script says, then stopped, its
// spools freed and its directories removed, until at least cfg.Kills agents were killed (and at
// least one episode ran per entry of cfg.Scale.Nodes). A violation after which the model no
// longer describes the agents ends its episode, and the run goes on with the next one. Run
// returns an error only when the run itself could not go on (the context ended, the work
// directory is unusable); every agent it started is gone and every mount it made is detached
// by the time it returns, also then.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("crashsim needs root: agents mount FUSE and a tmpfs spool")
	}
	plan := NewPlanner(cfg.Seed, cfg.Scale)
	cfg.Logf("crash-consistency run: seed %d, scale %s, at least %d kills (replay: MTCFS_SEED=%d)", cfg.Seed, cfg.Scale.Name, cfg.Kills, cfg.Seed)
	rep := &Report{Seed: cfg.Seed, Scale: cfg.Scale.Name, Kills: map[Kind]int{}, Hits: map[Kind]int{},
		Evidence: map[string]int{}, Restores: map[string]int{}, ErrorLines: map[string]int{}}
	start := time.Now()
	defer func() { rep.Duration = time.Since(start) }()
	for i := 0; rep.TotalKills() < cfg.Kills || i < len(cfg.Scale.Nodes); i++ {
		if ctx.Err() != nil {
			rep.Stopped = true
			return rep, ctx.Err()
		}
		spec := plan.Episode(i)
		cfg.Logf("episode %d: %s", i, spec)
		kills, found := rep.TotalKills(), len(rep.Violations())
		e := newEpisode(cfg, rep, i, spec)
		err := e.run(ctx)
		rep.Episodes = append(rep.Episodes, EpisodeReport{Spec: spec, Kills: rep.TotalKills() - kills,
			Violations: len(rep.Violations()) - found, Completed: e.completed})
		if err != nil {
			if ctx.Err() != nil {
				rep.Stopped = true
				return rep, ctx.Err()
			}
			return rep, fmt.Errorf("episode %d: %w", i, err)
		}
	}
	return rep, nil
}
