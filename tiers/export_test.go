package tiers

import "time"

// IdleClock is the CPU idle source of yield_test.go, for the package's external tests (a
// ReplicatorConfig.CPUIdle whose CPUs idle at a settable rate).
type IdleClock = idleClock

// NewIdleClock returns an IdleClock with cpus idle CPUs.
func NewIdleClock(cpus float64) *IdleClock { return &idleClock{cpus: cpus, known: true} }

func (c *idleClock) Read() (time.Duration, bool) { return c.read() }
func (c *idleClock) Set(cpus float64)            { c.set(cpus) }
