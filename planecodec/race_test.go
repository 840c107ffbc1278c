//go:build race

package planecodec

const raceEnabled = true
