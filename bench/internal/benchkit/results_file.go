package benchkit

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// A Section is the part of a Markdown results file that one bench program generates, between
// the lines "<!-- NAME:begin — NOTE -->" and "<!-- NAME:end -->". A new run replaces it; whatever
// else the file holds (other programs' sections, analysis written by hand) stays as it is.
type Section struct {
	Name string // the program, e.g. "fsbench"
	Note string // the rest of the begin marker, telling readers the section is generated
}

// Begin is the begin marker line, without a newline.
func (s Section) Begin() string { return "<!-- " + s.Name + ":begin — " + s.Note + " -->" }

// End is the end marker line, without a newline.
func (s Section) End() string { return "<!-- " + s.Name + ":end -->" }

// Update replaces the section in the file at path with text, which runs from the begin marker
// to the end marker; without a section there, text is appended, and a missing or empty file is
// started with a title.
func (s Section) Update(path, text string) error {
	old, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	doc := string(old)
	begin := strings.Index(doc, "<!-- "+s.Name+":begin")
	end := strings.Index(doc, s.End())
	switch {
	case len(old) == 0:
		doc = "# mtcfs benchmark results\n\nWhat is measured and how to run it: [README.md](README.md).\n\n" + text
	case begin >= 0 && end > begin:
		doc = doc[:begin] + text + strings.TrimPrefix(doc[end+len(s.End()):], "\n")
	default:
		doc = strings.TrimRight(doc, "\n") + "\n\n" + text
	}
	// A temporary file per program, so that two programs writing the same file cannot mix.
	tmp := path + "." + s.Name + ".tmp"
	if err := os.WriteFile(tmp, []byte(doc), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Publish prints text, the section of this run, and with out set puts it in place of the
// section in the file out, saying so on stderr.
func (s Section) Publish(out, text string) error {
	fmt.Print(text)
	if out == "" {
		return nil
	}
	if err := s.Update(out, text); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "%s: wrote results to %s\n", s.Name, out)
	return nil
}
