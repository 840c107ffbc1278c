// Package agent gives the deploy checks the mtcfs agent as the image ships it: the static
// binary (built like `make image` builds it), its mount flag set (read from the binary's own
// usage, so that a flag added to the agent is known here at once), a dry run of a manifest's
// command line through the agent's real flag parsing and validation, and the image's root
// filesystem laid out from deploy/Containerfile.prebuilt.
package agent

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// RepoRoot finds the root of the mtcfs repository (the directory of the agent's go.mod) from
// the working directory up.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.HasPrefix(data, []byte("module github.com/mtcfs/mtcfs\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("the mtcfs repository (go.mod of github.com/mtcfs/mtcfs) is not above the working directory")
		}
		dir = parent
	}
}

// Stage lays out the image's build context in dir with deploy/stage-image.sh, as make image
// does: dir/mtcfs is the static agent. It is built from the agent's own module, so the deploy
// module needs none of the agent's dependencies.
func Stage(dir string) error {
	root, err := RepoRoot()
	if err != nil {
		return err
	}
	cmd := exec.Command("sh", filepath.Join(root, "deploy", "stage-image.sh"), dir)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("deploy/stage-image.sh: %v\n%s", err, b)
	}
	return nil
}

// Flags is the agent's mount flag set: flag name → whether it is a boolean flag.
type Flags map[string]bool

// usageFlag matches a flag line of the flag package's PrintDefaults: "  -name" for a boolean,
// "  -name type" otherwise.
var usageFlag = regexp.MustCompile(`^  -([A-Za-z0-9][-A-Za-z0-9_]*)( \S+)?$`)

// MountFlags reads the mount flag set from `mtcfs mount -h`.
func MountFlags(bin string) (Flags, error) {
	out, err := exec.Command(bin, "mount", "-h").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("%s mount -h: %v\n%s", bin, err, out)
	}
	flags := Flags{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if m := usageFlag.FindStringSubmatch(sc.Text()); m != nil {
			flags[m[1]] = m[2] == ""
		}
	}
	if len(flags) < 5 || !flags.has("http") {
		return nil, fmt.Errorf("%s mount -h: no flag list in its usage:\n%s", bin, out)
	}
	return flags, nil
}

func (f Flags) has(name string) bool { _, ok := f[name]; return ok }

// Split separates a mount command line's arguments (after "mount") into positional arguments
// and flag values, as the flag package reads them: -x or --x, -x=v, -x v for a non-boolean. An
// unknown flag is an error. (The agent itself checks the values: Check.)
func (f Flags) Split(args []string) (pos []string, vals map[string]string, err error) {
	idx, vals, err := f.split(args)
	for _, i := range idx {
		pos = append(pos, args[i])
	}
	return pos, vals, err
}

// split is Split with the positional arguments given by their index in args.
func (f Flags) split(args []string) (pos []int, vals map[string]string, err error) {
	vals = map[string]string{}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			for j := i + 1; j < len(args); j++ {
				pos = append(pos, j)
			}
			return pos, vals, nil
		}
		if len(a) < 2 || a[0] != '-' {
			pos = append(pos, i)
			continue
		}
		name, val, hasVal := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
		isBool, ok := f[name]
		if !ok {
			return nil, nil, fmt.Errorf("flag %q is not a flag of mtcfs mount", a)
		}
		switch {
		case hasVal:
		case isBool:
			val = "true"
		case i+1 < len(args):
			i++
			val = args[i]
		default:
			return nil, nil, fmt.Errorf("flag %s needs a value", a)
		}
		vals[name] = val
	}
	return pos, vals, nil
}

// Check runs argv (a container's command line: mtcfs mount DIR flags...) through the agent
// binary bin, with DIR replaced by a directory that does not exist: the agent parses and
// validates every flag as it would in the pod, then stops at its first look at the mount point
// ("mount point … does not exist"), before it touches anything. A flag problem ends it with
// status 2 and the agent's own message.
func Check(bin string, flags Flags, argv []string) error {
	if len(argv) < 2 || filepath.Base(argv[0]) != "mtcfs" || argv[1] != "mount" {
		return fmt.Errorf("%q: want a command line mtcfs mount DIR [flags]", argv)
	}
	pos, _, err := flags.split(argv[2:])
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("%q: want exactly one mount directory, got %d positional arguments", argv, len(pos))
	}
	tmp, err := os.MkdirTemp("", "mtcfs-flagcheck-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	absent := filepath.Join(tmp, "absent")
	args := append([]string(nil), argv[1:]...)
	args[1+pos[0]] = absent
	cmd := exec.Command(bin, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.Dir = tmp
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		<-done
		return fmt.Errorf("mtcfs %s: still running after 30 s (it should stop at the absent mount point)\n%s", strings.Join(args, " "), out.String())
	}
	want := "mount point " + absent + " does not exist"
	if err != nil && strings.Contains(out.String(), want) {
		return nil // every flag passed; the run ended where it should
	}
	return fmt.Errorf("the agent refuses the command line %q (%v):\n%s", argv, err, strings.TrimSpace(out.String()))
}
