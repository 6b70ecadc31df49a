"""Test harness shared by the suites: real etcd, real torchrun nodes, polling helpers."""
