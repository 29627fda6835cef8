"""Workloads (installed as `hicache.scenarios`): trace readers, generators and scenario files."""
