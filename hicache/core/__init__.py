"""The pure core: deterministic state machines with no I/O, clock, threads, trio or torch."""
