// Package benchkit is what the benchmark programs under bench/ share: running an mtcfs agent as a
// child process and stopping it so that nothing stays mounted, reading /proc/mounts, turning
// Ctrl-C into a cancelled context, describing the machine and the binary under test, accounting
// for the CPU other processes took, medians and percentiles, the number formats of the reports,
// and replacing a program's generated section of bench/RESULTS.md.
//
// It lives under bench/internal so that only the bench programs can import it: it is measurement
// scaffolding, not part of mtcfs.
package benchkit
