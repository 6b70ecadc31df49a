"""``elastic local``: a whole cluster on one machine (embedded etcd, local nodes, faults).

The harness for the demo, the tests and trials; it starts real ``elastic agent`` process
trees and never runs in production.
"""
