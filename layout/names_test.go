package layout

import (
	"strings"
	"testing"
	"time"
)

var (
	hash64 = strings.Repeat("0123456789abcdef", 4)
	upper  = strings.ToUpper(hash64)
)

func TestParseStepDir(t *testing.T) {
	tests := []struct {
		name string
		step int64
		ok   bool
	}{
		{"0", 0, true},
		{"7", 7, true},
		{"12", 12, true},
		{"1000000", 1000000, true},
		{"9223372036854775807", 9223372036854775807, true},
		{"9223372036854775808", 0, false}, // beyond int64
		{"007", 0, false},                 // padded: not canonical
		{"00", 0, false},
		{"", 0, false},
		{"+1", 0, false},
		{"-1", 0, false},
		{" 1", 0, false},
		{"1 ", 0, false},
		{"1\n", 0, false},
		{"1.0", 0, false},
		{"1e3", 0, false},
		{"0x10", 0, false},
		{"١٢", 0, false}, // Arabic-Indic digits are not \d in the SPEC's sense
		{"12.orbax-checkpoint-tmp", 0, false},
		{"step=12", 0, false},
	}
	for _, tt := range tests {
		step, ok := ParseStepDir(tt.name)
		if step != tt.step || ok != tt.ok {
			t.Errorf("ParseStepDir(%q) = %d, %v; want %d, %v", tt.name, step, ok, tt.step, tt.ok)
		}
		if ok && StepDirName(step) != tt.name {
			t.Errorf("StepDirName(%d) = %q, want %q", step, StepDirName(step), tt.name)
		}
	}
}

func TestParseOrbaxTmpDir(t *testing.T) {
	tests := []struct {
		name string
		step int64
		ok   bool
	}{
		{"12.orbax-checkpoint-tmp", 12, true},
		{"0.orbax-checkpoint-tmp", 0, true},
		{".orbax-checkpoint-tmp", 0, false},
		{"012.orbax-checkpoint-tmp", 0, false},
		{"state.orbax-checkpoint-tmp", 0, false}, // an item dir inside a step, not a step
		{"12.orbax-checkpoint-tmp.x", 0, false},
		{"12", 0, false},
	}
	for _, tt := range tests {
		step, ok := ParseOrbaxTmpDir(tt.name)
		if step != tt.step || ok != tt.ok {
			t.Errorf("ParseOrbaxTmpDir(%q) = %d, %v; want %d, %v", tt.name, step, ok, tt.step, tt.ok)
		}
	}
}

func TestParseNemoNames(t *testing.T) {
	dirs := []struct {
		name string
		step int64
		ok   bool
	}{
		{"step=12", 12, true},
		{"step=0", 0, true},
		{"step=", 0, false},
		{"step=012", 0, false},
		{"step=-1", 0, false},
		{"step=12-unfinished", 0, false},
		{"Step=12", 0, false},
		{"step =12", 0, false},
		{"12", 0, false},
	}
	for _, tt := range dirs {
		step, ok := ParseNemoStepDir(tt.name)
		if step != tt.step || ok != tt.ok {
			t.Errorf("ParseNemoStepDir(%q) = %d, %v; want %d, %v", tt.name, step, ok, tt.step, tt.ok)
		}
	}
	unfinished := []struct {
		name string
		step int64
		ok   bool
	}{
		{"step=12-unfinished", 12, true},
		{"step=0-unfinished", 0, true},
		{"step=12", 0, false},
		{"step=-unfinished", 0, false},
		{"12-unfinished", 0, false},
		{"step=12-unfinished.tmp", 0, false},
		{"step=12-unfinished-unfinished", 0, false},
	}
	for _, tt := range unfinished {
		step, ok := ParseNemoUnfinished(tt.name)
		if step != tt.step || ok != tt.ok {
			t.Errorf("ParseNemoUnfinished(%q) = %d, %v; want %d, %v", tt.name, step, ok, tt.step, tt.ok)
		}
	}
}

func TestParseMarkerName(t *testing.T) {
	tests := []struct {
		name string
		want MarkerName
		ok   bool
	}{
		{"job-s1-n2-w3.meta", MarkerName{"job", 1, 2, 3, MarkerMeta}, true},
		{"job-s0-n0-w0.restore", MarkerName{"job", 0, 0, 0, MarkerRestore}, true},
		{"job-s100-n7-w15.save", MarkerName{"job", 100, 7, 15, MarkerSave}, true},
		{"my-job-s10-n0-w0.meta", MarkerName{"my-job", 10, 0, 0, MarkerMeta}, true},
		{"a-s1-n2-w3-s4-n5-w6.meta", MarkerName{"a-s1-n2-w3", 4, 5, 6, MarkerMeta}, true}, // the last triple is the marker's
		{"x-s-s1-n1-w1.meta", MarkerName{"x-s", 1, 1, 1, MarkerMeta}, true},
		{"maxtext.run_2-s5-n3-w0.restore", MarkerName{"maxtext.run_2", 5, 3, 0, MarkerRestore}, true},
		{"-s1-n2-w3.meta", MarkerName{}, false}, // the job part must not be empty
		{"a-s1-n2-w3.restore.tmp", MarkerName{}, false},
		{"a-s1-n2-w3.meta.tmp", MarkerName{}, false},
		{"a-s1-n2-w3.data", MarkerName{}, false},
		{"a-s1-n2-w3.", MarkerName{}, false},
		{"a-s1-n2-w3", MarkerName{}, false},
		{"a-s1-n2.meta", MarkerName{}, false},
		{"a-s1-w3-n2.meta", MarkerName{}, false},
		{"a-S1-n2-w3.meta", MarkerName{}, false},
		{"a-s1-n2-w3.META", MarkerName{}, false},
		{"a-s-1-n2-w3.meta", MarkerName{}, false},
		{"a-s+1-n2-w3.meta", MarkerName{}, false},
		{"a-s01-n2-w3.meta", MarkerName{}, false}, // padded numbers are not canonical
		{"a-s1-n02-w3.meta", MarkerName{}, false},
		{"a-s1-n2-w03.meta", MarkerName{}, false},
		{"a-s99999999999999999999-n2-w3.meta", MarkerName{}, false}, // step beyond int64
		{"a_s1_n2_w3.meta", MarkerName{}, false},
		{" a-s1-n2-w3.meta ", MarkerName{}, false},
	}
	for _, tt := range tests {
		got, ok := ParseMarkerName(tt.name)
		if got != tt.want || ok != tt.ok {
			t.Errorf("ParseMarkerName(%q) = %+v, %v; want %+v, %v", tt.name, got, ok, tt.want, tt.ok)
		}
		if ok && got.String() != tt.name {
			t.Errorf("ParseMarkerName(%q).String() = %q, want the name back", tt.name, got.String())
		}
	}
}

func TestMarkerNameString(t *testing.T) {
	m := MarkerName{Job: "maxtext-run", Step: 42, Node: 3, Worker: 1, Kind: MarkerRestore}
	if got, want := m.String(), "maxtext-run-s42-n3-w1.restore"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

func TestDataNames(t *testing.T) {
	tests := []struct {
		name string
		hash string
		dir  bool
		ok   bool
	}{
		{hash64 + ".data", hash64, false, true},
		{"D" + hash64 + ".data", hash64, true, true},
		{strings.Repeat("f", 64) + ".data", strings.Repeat("f", 64), false, true},
		{upper + ".data", "", false, false}, // upper-case hex is rejected
		{"D" + upper + ".data", "", false, false},
		{"d" + hash64 + ".data", "", false, false},
		{"DD" + hash64 + ".data", "", false, false},
		{hash64[:63] + ".data", "", false, false},
		{hash64 + "0.data", "", false, false},
		{hash64 + ".data.tmp", "", false, false},
		{hash64 + ".DATA", "", false, false},
		{hash64, "", false, false},
		{hash64[:63] + "g.data", "", false, false},
		{".data", "", false, false},
	}
	for _, tt := range tests {
		if got := IsDataName(tt.name); got != tt.ok {
			t.Errorf("IsDataName(%q) = %v, want %v", tt.name, got, tt.ok)
		}
		hash, dir, ok := ParseDataName(tt.name)
		if hash != tt.hash || dir != tt.dir || ok != tt.ok {
			t.Errorf("ParseDataName(%q) = %q, %v, %v; want %q, %v, %v", tt.name, hash, dir, ok, tt.hash, tt.dir, tt.ok)
		}
		if ok && DataName(hash, dir) != tt.name {
			t.Errorf("DataName(%q, %v) = %q, want %q", hash, dir, DataName(hash, dir), tt.name)
		}
	}
}

func TestValidateJobName(t *testing.T) {
	valid := []string{"j", "maxtext-run", "my_job.v2", "123", "-leading-dash", "a.b", strings.Repeat("x", 200)}
	for _, name := range valid {
		if err := ValidateJobName(name); err != nil {
			t.Errorf("ValidateJobName(%q) = %v, want nil", name, err)
		}
	}
	const allowed = `use only letters A-Z and a-z, digits, ".", "_" and "-"`
	invalid := []struct{ name, want string }{
		{"", "must not be empty"},
		{".", `"." starts with ".": the markers named after the job would be hidden files, which *.restore globs skip; start it with a letter, a digit, "_" or "-"`},
		{".hidden", `".hidden" starts with ".": the markers named after the job would be hidden files, which *.restore globs skip; start it with a letter, a digit, "_" or "-"`},
		{"..", `".." must not contain "/" or ".."`},
		{"a/b", `"a/b" must not contain "/" or ".."`},
		{"/", `"/" must not contain "/" or ".."`},
		{"a..b", `"a..b" must not contain "/" or ".."`},
		{"a b", `"a b" contains ' '; ` + allowed},
		{"a\x00b", `"a\x00b" contains '\x00'; ` + allowed},
		{"a\\b", `"a\\b" contains '\\'; ` + allowed},
		{"a*", `"a*" contains '*'; ` + allowed},
		{"naïve", `"naïve" contains 'ï'; ` + allowed},
		{strings.Repeat("x", 201), "is 201 bytes long; at most 200 are allowed"},
	}
	for _, tt := range invalid {
		err := ValidateJobName(tt.name)
		if err == nil || err.Error() != tt.want {
			t.Errorf("ValidateJobName(%q) = %v, want %q", tt.name, err, tt.want)
		}
	}
}

func TestBackupNameIsTheUTCMinute(t *testing.T) {
	local := time.Date(2030, 1, 2, 8, 34, 59, 999, time.FixedZone("UTC+5:30", 5*3600+1800))
	if got := BackupName(local); got != "2030-01-02_03-04" {
		t.Errorf("BackupName(%v) = %q, want 2030-01-02_03-04", local, got)
	}
}
