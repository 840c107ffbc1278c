package agent

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// Image is the content of the image deploy/Containerfile.prebuilt describes: files copied into
// an empty root, its environment and entrypoint.
type Image struct {
	Copies     []Copy   // in order
	Env        []string // NAME=VALUE
	Entrypoint []string
}

// Copy is one COPY line: a file of the build context to a path in the image.
type Copy struct {
	Src, Dst string
	Mode     os.FileMode
}

// ParseContainerfile reads a Containerfile of the form make image builds: FROM scratch, then
// only COPY (with --chmod), ENV, ENTRYPOINT, LABEL and comments. Anything else (RUN needs a
// shell the image does not have) is an error.
func ParseContainerfile(r io.Reader) (*Image, error) {
	img := &Image{}
	sc := bufio.NewScanner(r)
	from := false
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		word, rest, _ := strings.Cut(line, " ")
		fields := strings.Fields(rest)
		switch strings.ToUpper(word) {
		case "FROM":
			if rest != "scratch" || from {
				return nil, fmt.Errorf("line %d: only one FROM scratch is supported", n)
			}
			from = true
		case "COPY":
			c := Copy{Mode: 0o644}
			for len(fields) > 0 && strings.HasPrefix(fields[0], "--") {
				if m, ok := strings.CutPrefix(fields[0], "--chmod="); ok {
					var mode uint32
					if _, err := fmt.Sscanf(m, "%o", &mode); err != nil {
						return nil, fmt.Errorf("line %d: %s: %v", n, fields[0], err)
					}
					c.Mode = os.FileMode(mode)
				} else {
					return nil, fmt.Errorf("line %d: COPY option %s is not supported", n, fields[0])
				}
				fields = fields[1:]
			}
			if len(fields) != 2 {
				return nil, fmt.Errorf("line %d: want COPY SRC DST", n)
			}
			c.Src, c.Dst = fields[0], fields[1]
			img.Copies = append(img.Copies, c)
		case "ENV":
			if !strings.Contains(rest, "=") {
				return nil, fmt.Errorf("line %d: want ENV NAME=VALUE", n)
			}
			img.Env = append(img.Env, fields...)
		case "ENTRYPOINT":
			ep, err := jsonArray(rest)
			if err != nil {
				return nil, fmt.Errorf("line %d: %v", n, err)
			}
			img.Entrypoint = ep
		case "LABEL":
		default:
			return nil, fmt.Errorf("line %d: %s is not supported in an image built without a base", n, word)
		}
	}
	if !from {
		return nil, fmt.Errorf("no FROM scratch")
	}
	return img, sc.Err()
}

func jsonArray(s string) ([]string, error) {
	s = strings.TrimSpace(s)
	if !strings.HasPrefix(s, "[") || !strings.HasSuffix(s, "]") {
		return nil, fmt.Errorf("want the exec form [\"...\"]")
	}
	var out []string
	for _, f := range strings.Split(strings.Trim(s, "[]"), ",") {
		out = append(out, strings.Trim(strings.TrimSpace(f), `"`))
	}
	return out, nil
}

// Lay copies the image's files from the build context into root, as the image's layer has them.
func (img *Image) Lay(context, root string) error {
	for _, c := range img.Copies {
		dst := filepath.Join(root, c.Dst)
		if strings.HasSuffix(c.Dst, "/") {
			dst = filepath.Join(dst, filepath.Base(c.Src))
		}
		data, err := os.ReadFile(filepath.Join(context, c.Src))
		if err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(dst, data, c.Mode); err != nil {
			return err
		}
		if err := os.Chmod(dst, c.Mode); err != nil {
			return err
		}
	}
	return nil
}
